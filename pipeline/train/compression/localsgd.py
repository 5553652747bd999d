"""`localsgd`: each rank trains alone after warm-up and the models are averaged about every `localsgd_period` steps
(fp32, or their change since the last average in 8 bits with `localsgd_int8`).

Not among `auto`'s choices: it changes what is averaged (the model, not the gradients), so it cannot take over from a
gradient method at any step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from pipeline.train.compression import collectives
from pipeline.train.compression.method import Averager, CommCounter, CommHook, Epoch, Knobs, Method


def _hook(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
    # The default subgroup (one per node) raises on CPU (docs/torch-distributed.md#post-local-sgd-subgroup-on-cpu);
    # after warm-up no gradient is reduced at all.
    subgroup = dist.new_subgroups(group_size=1)[0]
    state = post_localSGD_hook.PostLocalSGDState(
        process_group=group,
        subgroup=subgroup,
        start_localSGD_iter=knobs.warmup_steps,
        post_local_gradient_allreduce=False,
    )

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if state.iter < state.start_localSGD_iter:
            counter.add(bucket.buffer().numel() * bucket.buffer().element_size())
        return post_localSGD_hook.post_localSGD_hook(state, bucket)

    return state, hook


class Schedule:
    """When an averaging is due: after warm-up, about every `period` steps, lined up with the epochs.

    Each epoch of S steps gets round(S / period) averagings (at least one), spread evenly, the last at its last step:
    the epoch's end needs the models one anyway (its evaluation and checkpoint), and an averaging a step or two before
    it would leave them apart again, to be settled by one more round over the link
    (docs/measurements.md#averagings-lined-up-with-the-epochs)."""

    def __init__(self, period: int, warmup_steps: int, epoch: Epoch) -> None:
        self.warmup_steps, self.step, self.done = warmup_steps, 0, epoch.done
        count = averagings(epoch.steps, period)
        self.ends = {math.ceil((i + 1) * epoch.steps / count) for i in range(count)}
        """Steps into an epoch (1 to S) after which an averaging is due."""
        self.steps = epoch.steps
        self.in_sync = True
        """Whether the ranks' models are one now: during warm-up (DDP all-reduces the gradients) and right after an
        averaging."""
        self.whole = True
        """An averaging makes the models one."""
        self.averaged = False
        """Whether the step just counted ended with an averaging (warm-up steps do not count)."""
        self.paces: list[float] = []
        """The share of the steps each rank trains (:meth:`pace`); empty: every rank every step."""
        self.since = 0
        """The first step whose changes the next averaging takes in."""
        self.weights: list[float] = []
        """Each rank's weight in the averaging just due: the ranks' number times its share of the steps trained
        since the one before; empty: all alike."""

    def pace(self, paces: list[float]) -> None:
        """From the next step, rank r trains `paces[r]` of the steps, spread evenly (every step during warm-up, where
        DDP all-reduces each one's gradients), and each averaging weighs a rank's change by the steps it trained.
        Called with the models one (an epoch's start), at the same step on every rank."""
        self.paces, self.since = list(paces), self.step

    def trains(self, rank: int) -> bool:
        """Whether `rank` trains at the next step (:meth:`pace`)."""
        return not self.paces or self.step < self.warmup_steps or trained(self.step, self.step + 1, self.paces[rank])

    def weight(self, rank: int) -> float:
        """`rank`'s weight in the averaging just due (1 while every rank trains every step)."""
        return self.weights[rank] if self.weights else 1.0

    def tick(self) -> bool:
        """Count a step; whether the model is averaged at it."""
        into = (self.done + self.step) % self.steps + 1
        due = self.step >= self.warmup_steps and into in self.ends
        self.step += 1
        self.in_sync = due or self.step <= self.warmup_steps
        self.averaged = due
        if due:
            self._close()
        return due

    def settle_due(self) -> bool:
        """Whether the models differ now, so that an averaging must make them one (counted as done)."""
        needed = not self.in_sync
        self.in_sync = True
        if needed:
            self._close()
        return needed

    def _close(self) -> None:
        """The weights of the averaging due now, and the start of the next one's steps."""
        start = max(self.since, self.warmup_steps)
        counts = [trained(start, self.step, pace) for pace in self.paces]
        self.weights = [len(counts) * c / sum(counts) for c in counts] if sum(counts) else []
        self.since = self.step


def averagings(steps: int, period: int) -> int:
    """Averagings in an epoch of `steps` steps about every `period` (:class:`Schedule`)."""
    return max(1, round(steps / period))


def trained(start: int, stop: int, pace: float) -> int:
    """Steps a rank at `pace` trains of steps `start` to `stop` - 1: those where ⌊(step + 1)·pace⌋ moves on (every
    1/pace-th step, as evenly as whole steps allow; the same count on every rank that computes it)."""
    return math.floor(stop * pace) - math.floor(start * pace)


class Fp32Averager:
    """An all-reduce of the parameters when due (torch's `average_parameters`), counting the bytes it sends."""

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        self.schedule, self.group = schedule, group

    def average(self, params: list[torch.Tensor]) -> int:
        """Average when due; the bytes sent."""
        return self._average(params) if self.schedule.tick() else 0

    def settle(self, params: list[torch.Tensor]) -> int:
        """Average now unless the models are one already; the bytes sent."""
        return self._average(params) if self.schedule.settle_due() else 0

    @torch.no_grad()
    def _average(self, params: list[torch.Tensor]) -> int:
        weigh(params, self.schedule, self.group)
        average_parameters(iter(params), self.group)
        return sum(p.numel() * p.element_size() for p in params)


def weigh(tensors: list[torch.Tensor], schedule: Schedule, group: dist.ProcessGroup | None) -> None:
    """Scale this rank's `tensors` in place by its weight in the averaging due (:meth:`Schedule.weight`): the mean
    over the ranks is then the weighted one."""
    weight = schedule.weight(dist.get_rank(group))
    if weight != 1.0:
        for t in tensors:
            t.mul_(weight)


def quantise_int8(
    changes: list[torch.Tensor], residual: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """`changes` plus what the last call's rounding left out (`residual`, empty the first time) in 8 bits: one int8
    per entry and one fp32 scale per tensor (its largest magnitude over 127); returns the int8 tensors, the scales
    and the new residual (error feedback)."""
    residual = residual or [torch.zeros_like(c) for c in changes]
    deltas = [c + r for c, r in zip(changes, residual, strict=True)]
    scales = torch.stack([d.abs().max() for d in deltas]).float().div_(127).clamp_(min=1e-30)
    quantised = [d.div(s).round_().clamp_(-127, 127).to(torch.int8) for d, s in zip(deltas, scales, strict=True)]
    return quantised, scales, [d - q.to(d.dtype) * s for d, q, s in zip(deltas, quantised, scales, strict=True)]


@dataclass
class Gathering:
    """An 8-bit all-gather of each rank's tensors, maybe still in flight (:func:`gather_int8`)."""

    parts: list[torch.Tensor]
    """Every rank's payload (int8 entries, then its fp32 scales as bytes), filled once :attr:`work` completes."""
    work: dist.Work | None
    """The collective in flight (None: it completed before `gather_int8` returned)."""
    sizes: list[int]
    """Entries of each tensor sent, in order."""

    @torch.no_grad()
    def mean(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Wait for the gather and return the mean over the ranks, as new tensors shaped as `like`. Every rank sums
        the same payloads in the same order, so the means are bit-identical."""
        if self.work is not None:
            self.work.wait()
        n = sum(self.sizes)
        mean = [torch.zeros_like(t) for t in like]
        for part in (p.to(like[0].device) for p in self.parts):  # in host memory when gathered by gloo
            their_scales = part[n:].clone().view(torch.float32)
            for m, q, s in zip(mean, part[:n].split(self.sizes), their_scales, strict=True):
                m.add_(q.view_as(m).to(m.dtype) * s)
        return [m.div_(len(self.parts)) for m in mean]


@torch.no_grad()
def gather_int8(
    changes: list[torch.Tensor], residual: list[torch.Tensor], group: dist.ProcessGroup | None, wait: bool = True
) -> tuple[Gathering, list[torch.Tensor], int]:
    """Start an all-gather of `changes` plus `residual` in 8 bits (:func:`quantise_int8`); return it (completed
    when `wait`), the new residual and the bytes this rank sent."""
    quantised, scales, residual = quantise_int8(changes, residual)
    payload = torch.cat([torch.cat([q.flatten() for q in quantised]), scales.view(torch.int8)])
    payload = collectives.gatherable(payload, group)
    parts = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, payload, group=group, async_op=not wait)
    return Gathering(parts, work, [c.numel() for c in changes]), residual, payload.numel()


class Int8Mean:
    """The mean over ranks of each rank's tensors (how far its model moved), sent in 8 bits: one int8 per entry and
    one fp32 scale per tensor, all-gathered, with error feedback (what rounding left out is added to the next
    call's tensors)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.residual: list[torch.Tensor] = []

    def mean(self, changes: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """The mean of `changes` over the ranks, and the bytes this rank sent."""
        gathering, self.residual, sent = gather_int8(changes, self.residual, self.group)
        return gathering.mean(changes), sent


class Int8DeltaAverager:
    """Local SGD's periodic averaging in 8 bits: each rank sends how far its model moved since the last average (its
    anchor, the same on every rank) through :class:`Int8Mean`. The first averaging, with no anchor yet, is in fp32."""

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        self.schedule, self.group = schedule, group
        self.int8 = Int8Mean(group)
        self.anchor: list[torch.Tensor] = []

    def average(self, params: list[torch.Tensor]) -> int:
        """Average when due; the bytes sent."""
        if not self.schedule.tick():
            return 0
        return self._deltas(params) if self.anchor else self._first(params)

    def settle(self, params: list[torch.Tensor]) -> int:
        """Average now unless the models are one already; the bytes sent."""
        if not self.schedule.settle_due():
            return 0
        return self._deltas(params) if self.anchor else self._first(params)

    @torch.no_grad()
    def _first(self, params: list[torch.Tensor]) -> int:
        weigh(params, self.schedule, self.group)
        collectives.all_reduce_flat(params, self.group, star=False)
        for p in params:
            p.div_(dist.get_world_size(self.group))
        self.anchor = [p.detach().clone() for p in params]
        return sum(p.numel() * p.element_size() for p in params)

    @torch.no_grad()
    def _deltas(self, params: list[torch.Tensor]) -> int:
        changes = [p - a for p, a in zip(params, self.anchor, strict=True)]
        weigh(changes, self.schedule, self.group)
        mean, sent = self.int8.mean(changes)
        for p, a, m in zip(params, self.anchor, mean, strict=True):
            p.copy_(a + m)
            a.copy_(p)
        return sent


def _averager(knobs: Knobs, group: dist.ProcessGroup | None) -> Averager:
    kind = Int8DeltaAverager if knobs.train.localsgd_int8 else Fp32Averager
    return kind(schedule(knobs), group)


def schedule(knobs: Knobs) -> Schedule:
    """The averaging schedule `knobs` ask for: `localsgd_period`, the warm-up, the epoch."""
    return Schedule(knobs.train.localsgd_period, knobs.warmup_steps, knobs.epoch)


METHOD = Method(
    name="localsgd",
    about="Each rank trains alone; the models are averaged every `localsgd_period` steps (`localsgd_int8`: 8 bits).",
    hook=_hook,
    warms_up=True,
    after_step=_averager,
    epochs_factor=2,
)
