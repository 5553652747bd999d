"""What a training rank runs: `python -m pipeline.train.rank.worker`, started by torchrun on this host or on a device.

Everything here, and everything it imports, must import on a device's Python 3.10 and torch 2.5 (JetPack 6): it
imports only the shared modules, :mod:`pipeline.train.compression` and this package, never the controller's code
(the stage in :mod:`pipeline.train`, :mod:`pipeline.train.launch`, :mod:`pipeline.train.cluster`). pyproject.toml's
import-linter contract "Training ranks import no controller code" holds that.
"""
