"""`star`: the full fp32 gradients summed through one rank (gathered to it, broadcast back) instead of DDP's ring
all-reduce: two rounds whatever the number of ranks, against the ring's 2(n - 1). Exact, as `none`; faster where
rounds cost more than bytes, slower on a large model over a thin link (pipeline/train/compression/collectives.py has the
measurements).

Not among `auto`'s choices yet: `auto` predicts from a timed ring all-reduce, whose latency is not the star's.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
from typing import Any

import torch
import torch.distributed as dist

from pipeline.train.compression import collectives
from pipeline.train.compression.method import CommCounter, CommHook, Knobs, Method, completed


def _hook(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        counter.add(buffer.numel() * buffer.element_size())
        collectives.star_all_reduce(buffer, group)
        return completed(buffer.div_(dist.get_world_size(group)))

    return None, hook


METHOD = Method(
    name="star",
    about="The full gradients summed through one rank (a gather, then a broadcast): 2 rounds, not the ring's 2(n−1).",
    hook=_hook,
    warms_up=False,
    blocking=True,
    payload_bytes=lambda params, knobs: 4 * sum(p.numel() for p in params),
    rounds=2,
    exact=True,
)
