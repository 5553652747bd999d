"""Each rank's share of the global batch, sized from how long its steps take, so that a slow or throttled board does
not set the pace of the others (an Orin Nano beside Orin NXs; a board slowed by heat).

Every rank runs the same number of steps, since a collective waits for all of them: with equal shares a rank half as
fast as the rest holds up every step by its whole excess. Instead each rank takes the share of the global batch that
makes its step as long as the others', predicted from what it measured over the last epoch (:func:`cost`): its
forward passes, which under DDP hold no collective (the wait for slower ranks is not counted as slowness), and its
optimizer step, which takes as long whatever the batch. Its loss is weighted by its share (:func:`loss_weight`), so
that DDP's mean of the ranks' gradients is still the mean over the global batch. Each rank's images come from one
permutation of the split per epoch, the same on every rank, cut at its share (:class:`ShareSampler`).

What a share cannot remove is what every step costs whatever its batch (the optimizer over every parameter, the
gradients' copies): a rank slow at that sets a floor under the step (docs/measurements.md#shares-of-the-batch).
Under the methods that average models every few steps, with no collective in between, a slow rank trains a share of
the steps instead (:func:`paces`), which leaves no such floor.
Shares stay equal while the ranks' predicted steps at equal shares are within :data:`TOLERANCE` of each other: on a
shared CPU they move by 10-20% from one epoch to the next, and following that would only reshuffle the data (and
make a seeded run's data order depend on the machine's load).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

TOLERANCE = 1.5
"""Longest predicted step at equal shares over the shortest below which the shares stay equal: an Orin Nano beside
an Orin NX, or a board throttled by heat, is 2x or more; two ranks sharing a busy CPU differ by 10-20%, and now and
then more."""
MIN_GAIN = 0.1
"""Shares stay equal too while what they could save, the slowest rank's predicted step over the mean, is below this
share of the measured step: on a slow link the ranks wait on it, not on each other, and a few milliseconds of
difference between ranks are the scheduler's."""
MIN_SHARE = 0.25
"""Fewest images a rank takes, as a fraction of an equal share: a rank that nearly stopped still trains, and its
BatchNorm still sees a batch."""
PASSES = 3
"""A training step's forward and backward, in forward passes: the backward pass costs about two."""


@dataclass(frozen=True)
class Timing:
    """What one rank measured over an epoch."""

    batch: int
    """Its images a step."""
    forward_s: float
    """Seconds of forward passes a step."""
    optimizer_s: float
    """Seconds of the optimizer step a step."""
    step_s: float = 0.0
    """Wall seconds a step, waiting for the others and the link included."""


def cost(now: Timing, before: Timing | None = None) -> tuple[float, float]:
    """(seconds, seconds an image) of a step of this rank, predicted from its last two epochs' timings: a line through
    its forward seconds at the two batches when they differ (a forward pass has a cost of its own, whatever its
    batch), else proportional to the batch; times :data:`PASSES`, plus the optimizer step."""
    per_image, fixed = now.forward_s / now.batch, 0.0
    if before is not None and before.batch != now.batch and before.forward_s > 0:
        slope = (now.forward_s - before.forward_s) / (now.batch - before.batch)
        if 0 < slope <= now.forward_s / now.batch:  # noise can put the line anywhere: only a plausible one counts
            per_image, fixed = slope, now.forward_s - slope * now.batch
    return now.optimizer_s + PASSES * fixed, PASSES * per_image


def split(
    total: int, now: Sequence[Timing], before: Sequence[Timing] | None = None, tolerance: float = TOLERANCE
) -> list[int]:
    """Per-rank batches summing to `total` (a multiple of the ranks) that make the ranks' predicted steps
    (:func:`cost`) as equal as they can be with none below :data:`MIN_SHARE` of an equal share; equal shares while
    the steps at equal shares are within `tolerance` of each other, or what shares could save is under
    :data:`MIN_GAIN` of a step."""
    n, even = len(now), total // len(now)
    if any(t.forward_s <= 0 or t.batch <= 0 for t in now):
        return [even] * n
    costs = [cost(t, b) for t, b in zip(now, before or [None] * n, strict=True)]
    at_even = [fixed + per_image * even for fixed, per_image in costs]
    gain = max(at_even) - sum(at_even) / n
    if max(at_even) < tolerance * min(at_even) or gain < MIN_GAIN * max(t.step_s for t in now):
        return [even] * n
    floor = max(math.ceil(MIN_SHARE * even), 1)
    exact = _equal_times(total, costs, floor)
    batches = [math.floor(e) for e in exact]
    by_remainder = sorted(range(n), key=lambda r: batches[r] - exact[r])
    for r in by_remainder[: total - sum(batches)]:
        batches[r] += 1
    return batches


def _equal_times(total: int, costs: Sequence[tuple[float, float]], floor: int) -> list[float]:
    """Batches (fractional) with every rank's fixed + per_image · batch the same time T, those that would go below
    `floor` held there (water-filling: T from the ranks still free, until none more falls below)."""
    pinned: set[int] = set()
    while True:
        free = [r for r in range(len(costs)) if r not in pinned]
        left = total - floor * len(pinned)
        time = (left + sum(costs[r][0] / costs[r][1] for r in free)) / sum(1 / costs[r][1] for r in free)
        below = {r for r in free if (time - costs[r][0]) / costs[r][1] < floor}
        if not below or len(pinned | below) == len(costs):
            return [floor if r in pinned else max((time - f) / p, floor) for r, (f, p) in enumerate(costs)]
        pinned |= below


def paces(now: Sequence[Timing], tolerance: float = TOLERANCE) -> list[float]:
    """Under a method that averages models every few steps, with no collective in between: the share of the steps
    each rank trains, so that a slow rank's steps take no longer, together, than the others'. A rank slower than the
    median one by more than a tenth trains the median's compute seconds a step over its own (the rest: every step),
    none below :data:`MIN_SHARE`; all train every step while the slowest is within `tolerance` of the fastest, or
    what pacing could save is under :data:`MIN_GAIN` of a step. Unlike a share of the batch, a share of the steps
    leaves nothing a step costs whatever its batch (docs/measurements.md#a-slow-rank-under-diloco)."""
    n = len(now)
    if any(t.forward_s <= 0 or t.batch <= 0 for t in now):
        return [1.0] * n
    took = [t.optimizer_s + PASSES * t.forward_s for t in now]
    typical = statistics.median(took)
    if max(took) < tolerance * min(took) or max(took) - typical < MIN_GAIN * max(t.step_s for t in now):
        return [1.0] * n
    # Within a tenth of the median is the scheduler's noise, not a slow board: those train every step.
    return [max(MIN_SHARE, typical / t) if t > (1 + MIN_GAIN) * typical else 1.0 for t in took]


def loss_weight(batches: Sequence[int], rank: int) -> float:
    """What this rank's mean loss is multiplied by: DDP divides the sum of the ranks' gradients by their number, and
    n · b_r / B makes that the mean over all B images of the step."""
    return len(batches) * batches[rank] / sum(batches)


class ShareSampler(Sampler[int]):
    """This rank's images of an epoch: `count` of them from position `start` of the epoch's permutation of `size`
    images (wrapping round when the shares add up to more), drawn from the seed and the epoch as
    DistributedSampler draws its permutation, so every rank cuts the same one."""

    def __init__(self, size: int, start: int, count: int, seed: int) -> None:
        self.size, self.start, self.count, self.seed = size, start, count, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's permutation."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[(self.start + torch.arange(self.count)) % self.size].tolist())

    def __len__(self) -> int:
        return self.count


def sampler(size: int, steps: int, batches: Sequence[int], rank: int, first: int, seed: int) -> ShareSampler:
    """Rank `rank`'s sampler for `steps` steps of `batches` images, over `size` images shared with ranks
    `first`..`rank` - 1 (those before it on the same images: all ranks for a shared split, the device's earlier
    local ranks for a device's own images)."""
    return ShareSampler(size, steps * sum(batches[first:rank]), steps * batches[rank], seed)
