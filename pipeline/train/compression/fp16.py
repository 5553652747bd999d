"""`fp16`: the gradients cast to float16 for the all-reduce (half the bytes); under FSDP, an fp16 reduce-scatter."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pipeline.train.compression.method import Method, stock

METHOD = Method(
    name="fp16",
    about="Gradients all-reduced as float16: half the bytes.",
    hook=stock(default_hooks.fp16_compress_hook, torch.float16),
    warms_up=False,
    fsdp=True,
    reduce_dtype=torch.float16,
    payload_bytes=lambda params, knobs: 2 * sum(p.numel() for p in params),
    encoder=lambda bucket, knobs, world, own: lambda: bucket.buffer().half().float(),
    auto=True,
)
