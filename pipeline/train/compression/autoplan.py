"""What `train.compression = "auto"` decides before the first step: DiLoCo for the whole run, or the gradient methods
it switches between per step (:mod:`.auto`).

DiLoCo cannot take over mid-run as a gradient method can: it averages models, not gradients, and `train.epochs =
"auto"` plans it twice the epochs (its :attr:`~.method.Method.epochs_factor`). So the choice is made once, from a
probe: every rank times a forward and backward pass of the model on its own batch and the link
(:func:`.auto.link_samples`: one sample where it settles the choice, else :data:`.auto.WINDOW`), the slowest rank's
numbers count, and every rank predicts, per step of the plain run, the time to accuracy of

- the gradient methods that average the gradient as it is (:attr:`~.method.Method.exact`: `none`, `fp16`): compute
  plus the cheapest of their collectives (the cast left out, which favours them);
- DiLoCo: its epochs factor times compute plus its outer step's collective spread over the steps between two
  (`localsgd_period`, lined up with the epochs: an epoch of S steps has round(S / period) of them).

The gradient methods that compress with a loss (`powersgd`, `topk`) learn less an epoch by an amount the prediction
has no factor for: on the cluster benchmark's links they never reached `none`'s accuracy in its epochs, and held
against their steps DiLoCo lost where it reached that accuracy in 0.31× `none`'s time
(docs/measurements.md#auto-chooses-diloco). So they do not count in this choice; once the gradient methods are
chosen, :mod:`.auto` still switches among all of them.

DiLoCo runs when it is predicted :data:`.auto.BAND` faster; a resumed run keeps the choice its checkpoint records.
On the quickstart's weak link (121 ms between devices) that is DiLoCo; on a LAN or one host, the gradient methods
(docs/measurements.md#auto-chooses-diloco).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.train.compression import auto, diloco, localsgd
from pipeline.train.compression.method import Knobs, Method

GRADIENTS = "auto"
"""The choice that leaves the run to :mod:`.auto`'s per-step switching among the gradient methods."""
DILOCO = diloco.METHOD.name
"""The choice of DiLoCo for the whole run."""
COMPUTE_REPEATS = 3
"""Timed forward and backward passes of the probe (after an untimed one); the median counts."""
SETTLE_FACTOR = 4.0
"""One link sample settles the choice when the link this many times faster or slower would not change it; else the
median of :data:`.auto.WINDOW` samples decides. On a weak link the probe's collectives go from 10 to 4, and the probe
is time `auto` spends before it trains (docs/measurements.md#auto-chooses-diloco)."""


@dataclass(frozen=True)
class Choice:
    """What `auto` runs, and the numbers it decided from."""

    method: str
    """:data:`DILOCO`, or :data:`GRADIENTS`."""
    reason: str
    latency_ms: float = 0.0
    mbit_per_s: float = 0.0
    compute_s: float = 0.0
    predicted_s: dict[str, float] | None = None
    """Predicted seconds of each candidate per step of the plain run (DiLoCo's times its epochs factor)."""
    probe_s: float = 0.0
    """Seconds the probe took on this rank."""
    probe_bytes: int = 0
    """Bytes this rank handed to the probe's collectives (its link samples, mostly)."""
    link_samples: int = 0
    """Link samples the probe took: 1 where the first settled the choice."""

    def record(self) -> dict[str, Any]:
        """The summary's `compression_choice`."""
        return asdict(self)

    def line(self) -> str:
        """The log line."""
        what = "diloco for the run" if self.method == DILOCO else "the gradient methods, chosen per step"
        text = f"compression auto: {what} ({self.reason})"
        if self.predicted_s:
            preds = ", ".join(f"{m} {s:.3f}" for m, s in sorted(self.predicted_s.items(), key=lambda kv: kv[1]))
            text += (
                f"; link {self.latency_ms:.2f} ms + {self.mbit_per_s:.1f} Mbit/s, compute {self.compute_s:.3f} s; "
                f"predicted s per plain-run step: {preds}; probe {self.probe_s:.1f} s, {self.link_samples} link "
                f"sample(s)"
            )
        return text


def outer_cost(params: list[torch.Tensor], knobs: Knobs) -> auto.Cost:
    """DiLoCo's outer step as one collective: the change in 8 bits plus a scale per tensor, all-gathered
    (`outer_int8`), or in fp32 all-reduced."""
    numel = sum(p.numel() for p in params)
    if knobs.train.outer_int8:
        return auto.Cost(DILOCO, numel + 4 * len(params), 0.0, gathers=True)
    return auto.Cost(DILOCO, 4 * numel, 0.0)


def predict(
    link: auto.LinkSample,
    compute_s: float,
    params: list[torch.Tensor],
    knobs: Knobs,
    world: int,
    gradient: Iterable[Method],
) -> dict[str, float]:
    """Seconds per step of the plain run's schedule on `world` ranks for DiLoCo and each gradient method (see the
    module's doc)."""
    predicted = {}
    for m in gradient:
        assert m.payload_bytes is not None, f"{m.name} is an auto candidate without a payload model"
        cost = auto.Cost(m.name, m.payload_bytes(params, knobs), 0.0, m.rounds, m.gathers)
        predicted[m.name] = auto.predict(cost, link, compute_s, world)
    outer = auto.predict(outer_cost(params, knobs), link, 0.0, world)
    steps = knobs.epoch.steps
    between = steps / localsgd.averagings(steps, knobs.train.localsgd_period)
    predicted[DILOCO] = diloco.METHOD.epochs_factor * (compute_s + outer / between)
    return predicted


def compared(gradient: Iterable[Method], params: list[torch.Tensor], knobs: Knobs) -> list[Method]:
    """The gradient methods DiLoCo is weighed against: of `gradient`, the exact ones that work on the model."""
    return [m for m in gradient if m.exact and m.refuses(params, knobs) is None]


def decide(predicted: dict[str, float], band: float = auto.BAND) -> tuple[str, str]:
    """DiLoCo when it is predicted `band` faster to accuracy than the fastest gradient method, else the gradient
    methods; and why."""
    ours = predicted[DILOCO]
    best = min((m for m in predicted if m != DILOCO), key=lambda m: predicted[m])
    if ours < (1 - band) * predicted[best]:
        return DILOCO, f"{ours / predicted[best]:.2f}x the time to accuracy of {best}"
    return GRADIENTS, f"diloco not {band:.0%} faster to accuracy than {best}"


def settled(choose: Callable[[auto.LinkSample], str], link: auto.LinkSample) -> bool:
    """Whether `choose` (a link's choice) stands with `link` :data:`SETTLE_FACTOR` times faster and as many times
    slower (while DiLoCo's outer step, spread over its period, costs less link time than a gradient step, a slower
    link only favours it more: the two ends bound the choice)."""
    return len({choose(link.scaled(f)) for f in (1 / SETTLE_FACTOR, 1.0, SETTLE_FACTOR)}) == 1


def time_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Callable[[], Any]) -> float:
    """Median seconds of a forward and backward pass of `model` on (`x`, `y`), after an untimed one. The model is left
    as it was: its gradients dropped, BatchNorm's running statistics put back (no copy of the model: on a 4 GB board
    a second one, with its optimizer state, may not fit)."""
    buffers = [b.clone() for b in model.buffers()]
    times = []
    try:
        for _ in range(COMPUTE_REPEATS + 1):
            start = time.perf_counter()
            with autocast():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
    return statistics.median(times[1:])


def probe(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    knobs: Knobs,
    gradient: Iterable[Method],
    autocast: Callable[[], Any],
    group: dist.ProcessGroup | None = None,
) -> Choice:
    """Time a step of `model` on this rank's `batch` and the link, and decide on the slowest rank's numbers (the
    same on every rank)."""
    if dist.get_world_size(group) == 1:
        return Choice(GRADIENTS, "one rank: nothing to send")
    start = time.perf_counter()
    x, y = batch
    compute = torch.tensor([time_step(model, x, y, autocast)], dtype=torch.float64, device=x.device)
    # The slowest rank's step; and, like any collective, it lines the ranks up for the link samples.
    dist.all_reduce(compute, op=dist.ReduceOp.MAX, group=group)
    world = dist.get_world_size(group)
    params = [p for p in model.parameters() if p.requires_grad]
    gradient = compared(gradient, params, knobs)

    def choose(link: auto.LinkSample) -> str:
        return decide(predict(link, compute.item(), params, knobs, world, gradient))[0]

    samples = auto.link_samples(group, x.device, 1, lined_up=True)
    if not settled(choose, samples[0]):
        samples += auto.link_samples(group, x.device, auto.WINDOW - 1, lined_up=True)
    link = auto.median_link(samples)
    predicted = predict(link, compute.item(), params, knobs, world, gradient)
    method, reason = decide(predicted)
    seconds = time.perf_counter() - start
    sent = compute.element_size() + len(samples) * auto.SAMPLE_BYTES
    ms, mbit = 1000 * link.latency_s, link.mbit_per_s
    return Choice(method, reason, ms, mbit, compute.item(), predicted, seconds, sent, len(samples))
