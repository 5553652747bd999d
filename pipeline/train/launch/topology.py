"""Where this host's training ranks sit in a torchrun job, as the CLI's flags give it, and whether torchrun can start
them here. Apart from the launcher so that the CLI and the stage's run() name it without the launcher's imports
(`models`, hence torchvision: seconds); torch itself comes with the parent package, `pipeline.train`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline import host
from pipeline.errors import PipelineError


@dataclass(frozen=True)
class Topology:
    """The torchrun multi-node placement of this host. The default is a single node with a rendezvous on a free
    loopback port; several nodes each run the same `nnodes` and `rdzv_endpoint` with their own `node_rank`."""

    nnodes: int = 1
    """How many hosts run the job (torchrun's --nnodes), each started on its own."""
    node_rank: int = 0
    """This host's rank among them, 0..nnodes-1; node 0 records the stage."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous, reachable from every node; required with several nodes. None: a free port on
    loopback."""
    nproc_per_node: int | None = None
    """Ranks on this host. None: `train.nproc_per_node`."""
    local_addr: str | None = None
    """This host's address as the other nodes reach it. None: what its hostname resolves to (torchrun's guess)."""

    def check(self, default_nproc: int) -> int:
        """Refuse, in one line naming the CLI flag, a placement torchrun cannot start on this host; returns the ranks
        it runs here (`nproc_per_node`, else `default_nproc`: the config's)."""
        nproc = default_nproc if self.nproc_per_node is None else self.nproc_per_node
        if nproc < 1:
            raise PipelineError(f"--nproc-per-node: must be at least 1, got {nproc}")
        if nproc > (slots := local_slots()):
            where = "GPUs" if host.cuda_present() else "CPU cores"
            raise PipelineError(f"--nproc-per-node: {nproc} ranks, but this node has {slots} {where}")
        if self.nnodes < 1:
            raise PipelineError(f"--nnodes: must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise PipelineError(f"--node-rank: must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise PipelineError("--rdzv-endpoint: required when --nnodes > 1 (host:port reachable from every node)")
        return nproc


SINGLE_NODE = Topology()
"""This host alone, its rendezvous on a free loopback port: `pipeline train` without --nnodes."""


def local_slots() -> int:
    """How many ranks this node can run: one per GPU, else one per CPU core (more only time-share them)."""
    import torch  # seconds to import: only once a launch is checked

    return torch.cuda.device_count() if host.cuda_present() else len(os.sched_getaffinity(0))
