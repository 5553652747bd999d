"""`streaming`: DiLoCo whose outer steps travel in the background while the next inner steps run (Streaming DiLoCo:
Douillard et al., "Streaming DiLoCo with overlapping communication", 2025, arXiv:2501.18512).

`diloco` stops every rank for its outer step: on a link where a collective costs a few round trips (121 ms each
between the cluster benchmark's devices), that is most of its communication time. Here the model's trainable tensors
are cut into `stream_fragments` fragments of about equal size, each with an outer step of its own every
`localsgd_period` steps, the fragments' turns spread over the period (the paper's peak bandwidth divided by the
fragment count). A fragment's change since its anchor goes in 8 bits with error feedback, as `diloco`'s
`outer_int8`, by an all-gather on a process group of its own (on the training group, DDP's collectives would queue
behind it), and the inner steps go on. `stream_delay_steps` later the rank takes the outer Nesterov step on the
averaged change, the same on every rank, and its fragment becomes the new anchor plus what this rank learnt since it
sent: the inner steps taken meanwhile are kept whole (the paper mixes the old and new fragment with a factor instead;
keeping them keeps every rank within `stream_delay_steps` steps of the shared anchor).

The epoch's end waits for what is in flight and takes one whole outer step, as `diloco` does, so that one model is
validated and saved; a checkpoint due mid-epoch does the same (the ranks' models are never one between: some
fragment always has steps of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline.train.compression import collectives, diloco, localsgd
from pipeline.train.compression.method import Averager, Knobs, Method


@dataclass
class Turns:
    """When each fragment sends (as the trainer reads it: :class:`.method.Timetable`)."""

    period: int
    """Steps between two outer steps of one fragment."""
    fragments: int
    """How many fragments take turns."""
    in_sync: bool = True
    """Whether the ranks' models are one now: only before the first step and after a settle."""
    whole: bool = False
    """An outer step of one fragment never makes the models one: a checkpoint settles them (method.Timetable)."""
    averaged: bool = False
    """No step ends with the models made one (method.Timetable)."""

    def sending(self, step: int) -> list[int]:
        """The fragments whose turn is at `step` (step 0 is the first averaging, of the whole model)."""
        return [
            f for f in range(self.fragments) if step > 0 and step % self.period == f * self.period // self.fragments
        ]


@dataclass
class InFlight:
    """One fragment's outer step on its way: what its end needs."""

    fragment: int
    """Which fragment."""
    gathering: localsgd.Gathering
    """The all-gather of the ranks' changes."""
    sent: list[torch.Tensor]
    """The fragment's parameters when it was sent: what the rank learns after is kept."""
    due: int
    """The step at which it is applied."""


def split(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """Indices of `params` in `count` (or fewer, if fewer tensors) runs of consecutive tensors of about equal size."""
    total = sum(p.numel() for p in params)
    runs: list[list[int]] = [[] for _ in range(min(count, len(params)))]
    done = 0
    for i, p in enumerate(params):
        # The run whose share of the total the tensor's middle falls in.
        runs[min(int((done + p.numel() / 2) * len(runs) / total), len(runs) - 1)].append(i)
        done += p.numel()
    return [r for r in runs if r]


class StreamingOuterStep:
    """The outer optimizer of :mod:`this module <pipeline.train.compression.streaming>`, fragment by fragment."""

    def __init__(self, knobs: Knobs, group: dist.ProcessGroup | None = None) -> None:
        train = knobs.train
        self.lr, self.momentum, self.delay = train.outer_lr, train.outer_momentum, train.stream_delay_steps
        self.group = group
        # A group of its own: a collective in flight on the training group would hold DDP's (its buffer broadcasts).
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        timeout = timedelta(seconds=train.pg_timeout_s)  # as the training group's, not torch's default
        self.background = dist.new_group(ranks, timeout, backend=dist.get_backend(group))
        self.schedule = Turns(train.localsgd_period, train.stream_fragments)
        self.fragments: list[list[int]] = []
        self.step = 0
        self.anchor: list[torch.Tensor] = []
        self.velocity: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] = []
        self.flying: list[InFlight] = []

    def average(self, params: list[torch.Tensor]) -> int:
        """Apply the outer steps due (a delay is at most the period: a fragment lands before its next turn), send the
        fragments whose turn it is; the bytes sent."""
        step, self.step = self.step, self.step + 1
        if step == 0:
            return self._first(params)
        self.schedule.in_sync = False
        for flight in [f for f in self.flying if f.due <= step]:
            self._land(params, flight)
        return sum(self._send(params, f, step) for f in self.schedule.sending(step))

    @torch.no_grad()
    def settle(self, params: list[torch.Tensor]) -> int:
        """Apply what is in flight, then one outer step of the whole model unless the models are one; the bytes."""
        for flight in list(self.flying):
            self._land(params, flight)
        if self.schedule.in_sync:
            return 0
        self.schedule.in_sync = True
        changes = [a - p for a, p in zip(self.anchor, params, strict=True)]
        gathering, self.residual, sent = localsgd.gather_int8(changes, self.residual, self.group)
        self._outer(params, list(range(len(params))), gathering.mean(changes), None)
        return sent

    def state(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outer momentum, as `diloco`'s (a checkpoint is of settled models: the anchor)."""
        velocity = self.velocity or [torch.zeros_like(p) for p in params]
        return {f"velocity.{i}": v for i, v in enumerate(velocity)}

    def restore(self, params: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Go on from a checkpoint: its momentum, its settled parameters as the anchor."""
        self._start(params)
        self.velocity = [state[f"velocity.{i}"] for i in range(len(params))]
        self.step = 1  # the first averaging is behind

    @torch.no_grad()
    def _first(self, params: list[torch.Tensor]) -> int:
        """The models averaged whole in fp32 (the ranks' first steps differ): the first anchor."""
        collectives.all_reduce_flat(params, self.group, star=False)
        for p in params:
            p.div_(dist.get_world_size(self.group))
        self._start(params)
        return sum(p.numel() * p.element_size() for p in params)

    def _start(self, params: list[torch.Tensor]) -> None:
        self.anchor = [p.detach().clone() for p in params]
        self.velocity = [torch.zeros_like(p) for p in params]
        self.residual = [torch.zeros_like(p) for p in params]
        self.fragments = split(params, self.schedule.fragments)
        self.schedule.fragments = len(self.fragments)  # a model of fewer tensors than fragments asked for

    @torch.no_grad()
    def _send(self, params: list[torch.Tensor], fragment: int, step: int) -> int:
        index = self.fragments[fragment]
        changes = [self.anchor[i] - params[i] for i in index]  # the pseudo-gradient, as diloco's
        residual = [self.residual[i] for i in index]
        gathering, residual, sent = localsgd.gather_int8(changes, residual, self.background, wait=False)
        for i, r in zip(index, residual, strict=True):
            self.residual[i] = r
        self.flying.append(
            InFlight(fragment, gathering, [params[i].detach().clone() for i in index], step + self.delay)
        )
        return sent

    def _land(self, params: list[torch.Tensor], flight: InFlight) -> None:
        self.flying.remove(flight)
        index = self.fragments[flight.fragment]
        self._outer(params, index, flight.gathering.mean([params[i] for i in index]), flight.sent)

    @torch.no_grad()
    def _outer(
        self, params: list[torch.Tensor], index: list[int], mean: list[torch.Tensor], sent: list[torch.Tensor] | None
    ) -> None:
        """The outer step of the tensors at `index` on their averaged change `mean`; each becomes the new anchor plus
        what it moved since `sent` (None: nothing kept, the models become one)."""
        anchor, velocity = [self.anchor[i] for i in index], [self.velocity[i] for i in index]
        diloco.nesterov(anchor, velocity, mean, self.lr, self.momentum)
        for k, i in enumerate(index):
            kept = params[i] - sent[k] if sent is not None else torch.zeros_like(params[i])
            params[i].copy_(self.anchor[i] + kept)


def _outer(knobs: Knobs, group: dist.ProcessGroup | None) -> Averager:
    return StreamingOuterStep(knobs, group)


METHOD = Method(
    name="streaming",
    about=(
        "DiLoCo with each fragment's outer step sent in the background, 8 bits, while the next inner steps run "
        "(Streaming DiLoCo)."
    ),
    hook=diloco.METHOD.hook,
    warms_up=False,
    after_step=_outer,
    epochs_factor=2,
)
