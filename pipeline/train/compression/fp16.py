"""`fp16`: the gradients cast to float16 for the all-reduce (half the bytes); under FSDP, an fp16 reduce-scatter."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pipeline.train.compression.method import cast

METHOD = cast(
    "fp16",
    "Gradients all-reduced as float16: half the bytes.",
    default_hooks.fp16_compress_hook,
    torch.float16,
    encoder=lambda bucket, knobs, world, own: lambda: bucket.buffer().half().float(),
    auto=True,
)
