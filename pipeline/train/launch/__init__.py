"""Starting this host's training ranks: torchrun's command line, its environment and the process group that stops
every rank with it (the controller side of a single- or multi-node run without SSH)."""
