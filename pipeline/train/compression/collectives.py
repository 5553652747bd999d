"""All-reduces with few rounds, for links where a round costs more than the bytes.

Between devices on a weak link a collective costs its rounds' latency more than its size. Measured on the cluster
benchmark's link (4 stand-ins, device to device 121 ms round trip, 20 Mbit/s), median of 5, seconds
(docs/measurements.md#collectives-on-a-weak-link):

| payload | gloo all-reduce (ring) | gather to one rank + broadcast (star) |
|---|---|---|
| 4 B | 0.24 | 0.12 |
| 81 KB | 0.74 | 0.17 |
| 1 MB | 0.85 | 1.38 |

The ring takes 2(n - 1) rounds, each waiting for its neighbour; the star takes two, but one rank receives and sends
everything. Below a few hundred KB the star wins; above, the ring.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensors` end to end in one new flat tensor (of `dtype`, else their own): one collective instead of one each."""
    return torch.cat([t.detach().flatten().to(dtype or t.dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `flat`'s consecutive pieces back into `tensors`, each in its own shape and dtype."""
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.detach().copy_(part.view_as(t))


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued kernels and collectives, so that a wall-clock time covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gatherable(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`tensor` as the group's backend can gather it: under gloo, whose gather and all-gather take CPU tensors only
    (docs/torch-distributed.md#no-nccl-on-jetson), a CUDA tensor's copy in host memory; else the tensor itself."""
    return tensor.cpu() if tensor.is_cuda and dist.get_backend(group) == "gloo" else tensor


def star_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum `flat` over the ranks in place through the group's first rank: gathered to it, summed there in rank order,
    broadcast back. Every rank ends with the same bits."""
    root = dist.get_global_rank(group, 0) if group is not None else 0
    world = dist.get_world_size(group)
    sent = gatherable(flat, group)
    parts = [torch.empty_like(sent) for _ in range(world)] if dist.get_rank() == root else None
    dist.gather(sent, parts, dst=root, group=group)
    if parts is not None:
        torch.sum(torch.stack(parts), dim=0, out=sent)
    dist.broadcast(sent, src=root, group=group)
    if sent is not flat:
        flat.copy_(sent)


def all_reduce_flat(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, star: bool = True) -> None:
    """Sum each of `tensors` (one dtype) over the ranks, in place, in one collective: the star (few bytes, as the
    epoch's end sends) or a ring all-reduce."""
    if not tensors:
        return
    flat = flatten(tensors)
    if star:
        star_all_reduce(flat, group)
    else:
        dist.all_reduce(flat, group=group)
    unflatten_into(flat, tensors)


def broadcast_flat(tensors: Sequence[torch.Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank `src`'s `tensors` to every rank, in place, with one broadcast. Sent as float64, which holds every
    float32, float16 and bfloat16 value and every integer below 2**53 (BatchNorm's batch counts) exactly."""
    if not tensors:
        return
    flat = flatten(tensors, torch.float64)
    dist.broadcast(flat, src=src, group=group)
    unflatten_into(flat, tensors)


class Fastest:
    """The faster of the ring and the star for one payload, measured on the first call: that call runs both on
    the real payload (the ring's result is kept) and every rank takes the slowest rank's times, so all choose alike."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.star: bool | None = None
        """Whether the star won; None until the first call."""
        self.seconds: tuple[float, float] = (0.0, 0.0)
        """(ring, star) seconds of the first call, the slowest rank's."""

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Sum `flat` over the ranks in place with the faster collective."""
        if self.star is None:
            self._measure(flat)
        elif self.star:
            star_all_reduce(flat, self.group)
        else:
            dist.all_reduce(flat, group=self.group)

    def _measure(self, flat: torch.Tensor) -> None:
        trial = flat.clone()
        start = time.perf_counter()
        dist.all_reduce(flat, group=self.group)
        ring = time.perf_counter() - start
        start = time.perf_counter()
        star_all_reduce(trial, self.group)
        times = torch.tensor([ring, time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
        self.seconds = (times[0].item(), times[1].item())
        self.star = self.seconds[1] < self.seconds[0]
