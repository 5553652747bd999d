"""Gradient compression as DDP communication hooks, each counting the bytes it puts on the wire.

A method is a factory in :data:`HOOKS`: given the process group and a :class:`CommCounter`, it returns the
(state, hook) pair for ``DistributedDataParallel.register_comm_hook``. New methods (PowerSGD, top-k, sign,
local SGD) slot in as further entries; each counts its own payload, since only it knows what it sends.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
HookFactory = Callable[[dist.ProcessGroup | None, "CommCounter"], tuple[Any, CommHook]]


@dataclass
class CommCounter:
    """Bytes of gradient payload this rank handed to collectives since the last :meth:`take`.

    The payload, not the algorithm's traffic: a ring all-reduce moves about 2(n-1)/n times this over the links,
    the same factor for every method, so the counter compares methods fairly.
    """

    bytes: int = 0

    def take(self) -> int:
        """Return the count and reset it (called once per optimizer step)."""
        count, self.bytes = self.bytes, 0
        return count


@dataclass
class _CountingState:
    group: dist.ProcessGroup | None
    counter: CommCounter


def _counting(inner: Callable[..., torch.futures.Future[torch.Tensor]], wire: torch.dtype | None) -> HookFactory:
    """Wrap a stock torch hook that takes (process_group, bucket): count numel * wire element size, then delegate."""

    def factory(group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        def hook(state: _CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            itemsize = (wire or buffer.dtype).itemsize
            state.counter.bytes += buffer.numel() * itemsize
            return inner(state.group, bucket)

        return _CountingState(group, counter), hook

    return factory


HOOKS: dict[str, HookFactory] = {
    "none": _counting(default_hooks.allreduce_hook, None),
    "fp16": _counting(default_hooks.fp16_compress_hook, torch.float16),
    "bf16": _counting(default_hooks.bf16_compress_hook, torch.bfloat16),
}


def install(model: DistributedDataParallel, method: str, group: dist.ProcessGroup | None = None) -> CommCounter:
    """Register the named compression hook on a DDP model and return the counter it fills."""
    counter = CommCounter()
    state, hook = HOOKS[method](group, counter)
    model.register_comm_hook(state, hook)
    return counter
