"""`diloco`: each rank trains alone (inner steps, with the run's own optimizer), and about every `localsgd_period` steps
the ranks average how far their models moved since the last outer step and take a Nesterov step on it (the outer
step), as DiLoCo does (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
arXiv:2311.08105, Algorithm 1: outer Nesterov SGD, learning rate 0.7; its momentum 0.9 is for hundreds of inner
steps, and the default here is 0.5: docs/measurements.md#diloco-outer-step).

One collective per outer step, of the parameters' size: in 8 bits by default (`outer_int8`), else in fp32 through the
faster of a ring and a star; the outer momentum is what local SGD lacks: the averaged change is a gradient of the
outer problem, and momentum on it lets the models move further per round of communication. The gradient hook is
local SGD's, with no warm-up: no gradient is ever all-reduced. `train.epochs = "auto"` gives it twice the epochs
(docs/measurements.md#diloco-epochs-and-defaults).
"""

import torch
import torch.distributed as dist

from pipeline.train.compression import collectives, localsgd
from pipeline.train.compression.method import Averager, Knobs, Method


class OuterStep:
    """The outer optimizer: when its schedule says (about every `localsgd_period` steps), average the ranks' change
    since the anchor (the parameters after the last outer step, the same on every rank) and step the anchor by
    Nesterov SGD on it; every rank then continues from the new anchor. The first outer step, with no anchor yet, only
    averages the models.

    The change goes in fp32 through the faster of a ring all-reduce and a star (measured at the first outer step:
    collectives.Fastest), or with `int8` in 8 bits with error feedback (localsgd.Int8Mean)."""

    def __init__(
        self,
        schedule: localsgd.Schedule,
        lr: float,
        momentum: float,
        group: dist.ProcessGroup | None = None,
        int8: bool = False,
    ) -> None:
        self.schedule = schedule
        self.lr, self.momentum, self.group = lr, momentum, group
        self.collective = collectives.Fastest(group)
        self.int8 = localsgd.Int8Mean(group) if int8 else None
        self.anchor: list[torch.Tensor] = []
        self.velocity: list[torch.Tensor] = []

    def average(self, params: list[torch.Tensor]) -> int:
        """Take the outer step when due; the bytes sent."""
        if not self.schedule.tick():
            return 0
        return self._step(params)

    def settle(self, params: list[torch.Tensor]) -> int:
        """Take an outer step now unless the models are one already (the last step took one); the bytes sent."""
        if not self.schedule.settle_due():
            return 0
        return self._step(params)

    def state(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outer momentum, for a checkpoint (zeros before the first outer step). The anchor needs no copy: a
        checkpoint is of settled models, which are the anchor."""
        velocity = self.velocity or [torch.zeros_like(p) for p in params]
        return {f"velocity.{i}": v for i, v in enumerate(velocity)}

    def restore(self, params: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Go on from a checkpoint: its momentum, and its (settled) parameters as the anchor, so that the next outer
        step is a Nesterov step as it would have been, not a first one that only averages the models."""
        self.anchor = [p.detach().clone() for p in params]
        self.velocity = [state[f"velocity.{i}"] for i in range(len(params))]

    @torch.no_grad()
    def _step(self, params: list[torch.Tensor]) -> int:
        first = not self.anchor
        # The pseudo-gradient points as a gradient does: from where the models went back to the anchor.
        moved = (
            [p.detach().clone() for p in params] if first else [a - p for a, p in zip(self.anchor, params, strict=True)]
        )
        localsgd.weigh(moved, self.schedule, self.group)  # `moved` is this step's own
        mean, sent = self._mean(moved, first)
        if first:
            self.anchor = [m.clone() for m in mean]
            self.velocity = [torch.zeros_like(m) for m in mean]
        else:
            nesterov(self.anchor, self.velocity, mean, self.lr, self.momentum)
        for p, a in zip(params, self.anchor, strict=True):
            p.copy_(a)
        return sent

    def _mean(self, moved: list[torch.Tensor], first: bool) -> tuple[list[torch.Tensor], int]:
        """The mean of `moved` over the ranks, and the bytes sent (the first, whole models, always in fp32)."""
        if self.int8 is not None and not first:
            return self.int8.mean(moved)
        flat = collectives.flatten(moved).div_(dist.get_world_size(self.group))
        self.collective.all_reduce(flat)
        collectives.unflatten_into(flat, moved)  # `moved` is this step's own: it becomes the mean
        return moved, flat.numel() * flat.element_size()


@torch.no_grad()
def nesterov(
    anchor: list[torch.Tensor], velocity: list[torch.Tensor], mean: list[torch.Tensor], lr: float, momentum: float
) -> None:
    """One outer Nesterov SGD step of `anchor`, in place, on the averaged pseudo-gradient `mean`."""
    for a, v, g in zip(anchor, velocity, mean, strict=True):
        v.mul_(momentum).add_(g)
        a.sub_(g.add(v, alpha=momentum), alpha=lr)  # Nesterov: g + momentum * v


def _outer(knobs: Knobs, group: dist.ProcessGroup | None) -> Averager:
    train = knobs.train
    return OuterStep(localsgd.schedule(knobs), train.outer_lr, train.outer_momentum, group, train.outer_int8)


METHOD = Method(
    name="diloco",
    about="Local training; every `localsgd_period` steps an outer Nesterov step on the averaged change (DiLoCo).",
    hook=localsgd.METHOD.hook,
    warms_up=False,  # a warm-up cost more bytes than it saved epochs (docs/measurements.md#diloco-epochs-and-defaults)
    after_step=_outer,
    epochs_factor=2,
)
