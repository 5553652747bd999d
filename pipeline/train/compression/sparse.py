"""What the all_gather methods (top-k, sign) share: error feedback per bucket, warm-up, one gather per bucket.

Gloo constraints shape them (docs/torch-distributed.md#all-gather-hooks-keyed-by-bucket): each runs one asynchronous
all_gather per bucket into buffers of its own, issued in DDP's bucket order on every rank, and keys its error feedback
by bucket index (DDP rebuilds its buckets after the first step).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.train.compression import collectives
from pipeline.train.compression.method import (
    Bucket,
    CommCounter,
    CommHook,
    EncoderFactory,
    HookFactory,
    Knobs,
    Method,
    PayloadModel,
    allreduce,
    completed,
)


class Steps:
    """Optimizer steps seen by a hook: DDP calls the last bucket (`is_last`) once per synchronised step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.done = warmup, 0

    def warming(self) -> bool:
        """True while plain all-reduce is still due."""
        return self.done < self.warmup

    def tick(self, bucket: Bucket) -> None:
        """Count a step when its last bucket passes."""
        if bucket.is_last():
            self.done += 1


@dataclass
class SparseState:
    """Error feedback per bucket index (reset when DDP rebuilds a bucket with a different size) and a step count."""

    group: dist.ProcessGroup | None
    counter: CommCounter
    steps: Steps
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def corrected(self, bucket: Bucket) -> torch.Tensor:
        """This bucket's gradient plus what earlier steps did not send."""
        grad = bucket.buffer()
        residual = self.residuals.get(bucket.index())
        return grad.clone() if residual is None or residual.shape != grad.shape else grad + residual

    def gather(
        self, payload: torch.Tensor, decode: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        """Start gathering every rank's payload (same shape on all), counted as this rank's bytes on the wire; the
        future holds `decode` of them. One collective per bucket, issued in DDP's bucket order on every rank, so
        ranks agree on the order without waiting (docs/torch-distributed.md#all-gather-hooks-keyed-by-bucket)."""
        self.counter.add(payload.numel() * payload.element_size())
        device, sent = payload.device, collectives.gatherable(payload, self.group)
        out = [torch.empty_like(sent) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(out, sent, group=self.group, async_op=True)
        return work.get_future().then(lambda _: decode([o.to(device) for o in out]))


class _LocalSparse(SparseState):
    """A state whose gather decodes `world` copies of this rank's payload instead of communicating."""

    world: int = 2

    def gather(
        self, payload: torch.Tensor, decode: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        return completed(decode([payload.clone() for _ in range(self.world)]))


Compressor = Callable[[SparseState, Bucket, Knobs], torch.futures.Future[torch.Tensor]]
"""Compress a bucket's corrected gradient, keep what it did not send, and gather every rank's payload."""


def hook(compress: Compressor) -> HookFactory:
    """An all_gather method's hook: plain all-reduce during warm-up, then `compress` with error feedback."""

    def factory(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        def sparse_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            warming = state.steps.warming()
            state.steps.tick(bucket)
            return allreduce(state.group, state.counter, bucket) if warming else compress(state, bucket, knobs)

        return SparseState(group, counter, Steps(knobs.warmup_steps)), sparse_hook

    return factory


def encoder(compress: Compressor) -> EncoderFactory:
    """Time `compress` on a bucket alone: its gather decodes `world` copies of this rank's payload."""

    def factory(bucket: Bucket, knobs: Knobs, world: int, own: dist.ProcessGroup | None) -> Callable[[], object]:
        state = _LocalSparse(None, CommCounter(), Steps(0))
        state.world = world
        return lambda: compress(state, bucket, knobs).wait()

    return factory


def residuals(state: SparseState) -> dict[int, torch.Tensor]:
    """The error feedback not sent yet, per bucket index."""
    return dict(state.residuals)


def method(name: str, about: str, compress: Compressor, payload: PayloadModel) -> Method:
    """An all_gather method with error feedback and a warm-up, which `auto` may switch to at any step."""
    return Method(
        name=name,
        about=about,
        hook=hook(compress),
        warms_up=True,
        payload_bytes=payload,
        gathers=True,
        encoder=encoder(compress),
        residuals=residuals,
        auto=True,
    )
