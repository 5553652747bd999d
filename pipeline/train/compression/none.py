"""`none`: DDP's own all-reduce of the fp32 gradients (the baseline every other method is measured against)."""

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from pipeline.train.compression.method import Method, stock

METHOD = Method(
    name="none",
    about="DDP's own all-reduce of the full gradients.",
    hook=stock(default_hooks.allreduce_hook, None),
    warms_up=False,
    fsdp=True,
    payload_bytes=lambda params, knobs: 4 * sum(p.numel() for p in params),
    auto=True,
    exact=True,
)
