"""`bf16`: the gradients cast to bfloat16 for the all-reduce; under FSDP, a bf16 reduce-scatter.

Not among `auto`'s choices: the same bytes as fp16 with fewer mantissa bits.
"""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pipeline.train.compression.method import cast

METHOD = cast(
    "bf16",
    "Gradients all-reduced as bfloat16: half the bytes, fp32's range.",
    default_hooks.bf16_compress_hook,
    torch.bfloat16,
)
