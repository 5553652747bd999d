"""`powersgd`: torch's PowerSGD hook, a rank-`powersgd_rank` approximation of each weight matrix, error feedback.

Gloo: its P/Q all-reduces start from callbacks, so the hook waits for its own future before returning and every rank
issues them in the same order whatever the number of buckets (docs/torch-distributed.md#powersgd-on-gloo). Blocking,
so DDP gives it one bucket.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from pipeline.train.compression.method import Bucket, CommCounter, CommHook, Knobs, Method


def sent_numel(shapes: list[torch.Size], rank: int) -> int:
    """Elements PowerSGD sends per step: P (n x r) and Q (m x r) for each tensor it compresses (a matrix, viewed as
    n x m, where that is smaller), every other tensor as it is (as torch's PowerSGD hook decides)."""
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape) // n
        r = min(n, m, rank)
        # torch compresses a matrix only where that at least halves it (min_compression_rate=2).
        total += (n + m) * r if len(shape) > 1 and n * m > 2 * (n + m) * r else math.prod(shape)
    return total


def _hook(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=knobs.train.powersgd_rank,
        start_powerSGD_iter=max(knobs.warmup_steps, 2),
        use_error_feedback=True,
        warm_start=True,
    )

    def hook(state: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        warming = state.iter < state.start_powerSGD_iter
        before = state.total_numel_after_compression
        fut = powerSGD_hook.powerSGD_hook(state, bucket)
        buffer = bucket.buffer()
        # PowerSGD tallies the elements it sends once compressing (P, Q and the tensors it leaves uncompressed).
        numel = buffer.numel() if warming else state.total_numel_after_compression - before
        counter.add(numel * buffer.element_size())
        fut.wait()  # gloo: the same order of collectives on every rank (module docstring)
        return fut

    return state, hook


def _payload(params: list[torch.Tensor], knobs: Knobs) -> int:
    return 4 * sent_numel([p.shape for p in params], knobs.train.powersgd_rank)


def _encoder(bucket: Bucket, knobs: Knobs, world: int, own: dist.ProcessGroup | None) -> Any:
    """torch's own hook on a group of this rank alone, whose all-reduces cost nothing, past its 2 plain steps."""
    state, hook = _hook(replace(knobs, warmup_steps=2), own, CommCounter())
    for _ in range(2):
        hook(state, bucket).wait()  # type: ignore[arg-type]
    return lambda: hook(state, bucket).wait()  # type: ignore[arg-type]


def _refuses(params: list[torch.Tensor], knobs: Knobs) -> str | None:
    if _payload(params, knobs) < 4 * sum(p.numel() for p in params):
        return None
    rank = knobs.train.powersgd_rank
    return f"no weight matrix of this model is large enough for rank {rank} to shrink it; use topk or sign"


METHOD = Method(
    name="powersgd",
    about="A low-rank (`powersgd_rank`) approximation of each weight matrix, with error feedback.",
    hook=_hook,
    warms_up=True,
    min_warmup_steps=2,
    blocking=True,
    payload_bytes=_payload,
    rounds=3,  # the uncompressed tensors, P, then Q
    encoder=_encoder,
    residuals=lambda state: dict(state.error_dict),
    auto=True,
    refuses=_refuses,
)
