"""FSDP2 (`fully_shard`) from wherever this torch keeps it, and whether it can run without CUDA.

torch 2.6 made it public as `torch.distributed.fsdp`; 2.4 and 2.5 (NVIDIA's wheels for JetPack 6) have the same
API under `torch.distributed._composable.fsdp`, where it needs CUDA streams and fails on a CPU at the first forward
("FSDP requires CUDA for streams"). See docs/torch-distributed.md#fsdp2-before-26.
"""

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    NEEDS_CUDA = False
except ImportError:
    from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    NEEDS_CUDA = True
"""True when this torch's FSDP2 runs only on CUDA devices (torch < 2.6)."""

__all__ = ["NEEDS_CUDA", "FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
