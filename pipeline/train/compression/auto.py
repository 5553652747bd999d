"""`train.compression = "auto"`: measure the link, the step's compute and each method's cost, run the fastest.

After the compression warm-up, and every `compression_auto_every_steps` steps after it, every rank measures the
steps since the last measurement (wall time less the hook's: compute; and the hook's own seconds), once, each
candidate's encoding on this model's gradients and, when :class:`LinkWatch` says the link may have moved, a timed
4-byte and :data:`PROBE_BYTES` all-reduce (latency and seconds per byte). One all-reduce gives every rank the slowest
rank's numbers; from them every rank predicts each candidate's step time (:func:`predict`) and decides
(:class:`Policy`: the median of the last :data:`WINDOW` link samples, a switch only when another method is
:data:`BAND` faster at :data:`PATIENCE` measurements in a row). Same numbers, same pure decision: every rank switches
at the same step and issues the same collectives in the same order, with no broadcast.

DDP takes one communication hook for its lifetime: the registered hook dispatches to the running method's own
(state, hook). On a switch the old method's error feedback (what it has not sent yet) is carried: it is added to the
next step's gradient, which the new method then sends, and the old state is dropped.

`auto` knows the other methods only through their records (:class:`~.method.Method`): it chooses among those marked
`auto`, predicts from their `payload_bytes`, `rounds` and `gathers`, times their `encoder` and carries their
`residuals`.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from pipeline.train.compression import collectives
from pipeline.train.compression.method import CommCounter, CommHook, Compression, Knobs, LocalBucket, Method, timed

PROBE_BYTES = 512 * 1024
"""Size of the timed all-reduce: above tbf's and most NICs' bursts, yet 0.4 s at 10 Mbit/s."""
WINDOW = 3
"""Link samples whose median a decision uses; the first decision takes this many back to back."""
BAND = 0.2
"""Another method must be predicted this much faster than the running one before it is considered."""
PATIENCE = 2
"""Measurements in a row that must favour the same other method before a switch."""
RECHECK = 5
"""Measurements between link samples while the running method's own communication time holds still."""
WATCH_BAND = 0.5
"""How far the running method's hook seconds per step must move to count as the link changing: CPU noise on a
shared machine moves them by 20-30% from one measurement to the next; a link changing by a factor of 2 or more,
enough to change the best method, moves them further. Smaller changes wait for the :data:`RECHECK`."""
WATCH_FLOOR_S = 0.005
"""Smallest move of the running method's hook seconds per step that counts as the link changing."""
BASELINE = "none"
"""The method warm-up runs and the first decision measures the others against: plain all-reduce."""


@dataclass(frozen=True)
class LinkSample:
    """One measurement of the link between the ranks."""

    latency_s: float
    """Seconds of a 4-byte all-reduce."""
    s_per_byte: float
    """Further seconds per byte of all-reduce payload."""

    @classmethod
    def from_timings(cls, small_s: float, large_s: float, large_bytes: int) -> "LinkSample":
        """From a timed 4-byte all-reduce and a timed `large_bytes` one."""
        return cls(small_s, max(large_s - small_s, 0.0) / (large_bytes - 4))

    @property
    def mbit_per_s(self) -> float:
        """Payload throughput of a large all-reduce, in Mbit/s."""
        return 8e-6 / self.s_per_byte if self.s_per_byte > 0 else float("inf")

    def scaled(self, factor: float) -> "LinkSample":
        """The link `factor` times as slow: latency and seconds per byte both."""
        return LinkSample(self.latency_s * factor, self.s_per_byte * factor)


def median_link(samples: Iterable[LinkSample]) -> LinkSample:
    """Median latency and median seconds per byte: one stalled sample moves neither."""
    samples = list(samples)
    return LinkSample(statistics.median(s.latency_s for s in samples), statistics.median(s.s_per_byte for s in samples))


@dataclass(frozen=True)
class Cost:
    """What one candidate costs per step on this model, apart from the link."""

    method: str
    payload_bytes: int
    """Bytes it hands to collectives per step (as `comm_bytes` counts them)."""
    encode_s: float
    """Seconds of compressing and decompressing a step's gradients, measured on this model."""
    rounds: int = 1
    """Collectives it runs one after the other per step (:attr:`.method.Method.rounds`)."""
    gathers: bool = False
    """Whether it all_gathers: each rank receives every other rank's payload, (n - 1)·p bytes, where a ring
    all-reduce moves 2(n - 1)/n·p."""


def predict(cost: Cost, link: LinkSample, compute_s: float, world: int) -> float:
    """Predicted seconds per step: compute, encoding, a latency per sequential collective, and the payload's time."""
    per_byte = link.s_per_byte * (world / 2 if cost.gathers else 1.0)
    return compute_s + cost.encode_s + cost.rounds * link.latency_s + cost.payload_bytes * per_byte


@dataclass(frozen=True)
class Decision:
    """One measurement's outcome, with the numbers it was made from."""

    step: int
    method: str
    previous: str | None
    reason: str
    latency_ms: float
    mbit_per_s: float
    compute_s: float
    predicted_s: dict[str, float]

    @property
    def switched(self) -> bool:
        """Whether the method changes at this step."""
        return self.method != self.previous

    def record(self) -> dict[str, Any]:
        """The metrics line's `compression_decision`."""
        return {**asdict(self), "switched": self.switched}

    def line(self) -> str:
        """The log line."""
        preds = ", ".join(f"{m} {s:.3f}" for m, s in sorted(self.predicted_s.items(), key=lambda kv: kv[1]))
        verb = f"{self.previous or 'warm-up'} -> {self.method}" if self.switched else f"stays {self.method}"
        return (
            f"compression auto: step {self.step}: {verb} ({self.reason}); link {self.latency_ms:.2f} ms + "
            f"{self.mbit_per_s:.1f} Mbit/s, compute {self.compute_s:.3f} s; predicted s/step: {preds}"
        )


@dataclass
class Policy:
    """Rank 0's decisions from measurements: pure, so tests feed it numbers."""

    world: int
    window: int = WINDOW
    band: float = BAND
    patience: int = PATIENCE
    current: str | None = None
    samples: deque[LinkSample] = field(default_factory=deque)
    streak: tuple[str, int] = ("", 0)

    def observe(self, step: int, samples: list[LinkSample], compute_s: float, costs: list[Cost]) -> Decision:
        """Add link samples, predict every candidate's step time and decide which method runs from here."""
        self.samples.extend(samples)
        while len(self.samples) > self.window:
            self.samples.popleft()
        link = median_link(self.samples)
        predicted = {c.method: predict(c, link, compute_s, self.world) for c in costs}
        best = min(predicted, key=lambda m: predicted[m])
        previous, method = self.current, self.current
        if previous is None or previous not in predicted:
            # Warm-up ran plain all-reduce: compressing must pay for itself by the band from the start too.
            gain = BASELINE in predicted and predicted[best] > (1 - self.band) * predicted[BASELINE]
            method = BASELINE if gain else best
            reason = f"first measurement{f', {best} within {self.band:.0%} of {BASELINE}' if gain else ''}"
        elif best == previous:
            self.streak, reason = ("", 0), "fastest"
        elif predicted[best] > (1 - self.band) * predicted[previous]:
            self.streak = ("", 0)
            reason = f"{best} within {self.band:.0%} of {previous}"
        else:
            count = self.streak[1] + 1 if self.streak[0] == best else 1
            self.streak = (best, count)
            reason = f"{best} faster by more than {self.band:.0%} ({count}/{self.patience})"
            if count >= self.patience:
                method, self.streak = best, ("", 0)
        self.current = method
        assert method is not None
        ms = 1000 * link.latency_s
        return Decision(step, method, previous, reason, ms, link.mbit_per_s, compute_s, predicted)


@dataclass
class LinkWatch:
    """When to time the link again. Timing it costs (a 512 KiB all-reduce takes 0.4 s at 10 Mbit/s), and the running
    method already times its own collectives every step: the link is sampled again only when those seconds move by
    :data:`WATCH_BAND` (then :data:`WINDOW` fresh samples, so the median follows at once) or every :data:`RECHECK`
    measurements. Pure, like :class:`Policy`; every rank runs it on the same numbers and so agrees."""

    band: float = WATCH_BAND
    floor_s: float = WATCH_FLOOR_S
    recheck: int = RECHECK
    baseline: float | None = None
    """The running method's hook seconds per step when last seen steady (None: take the next as the baseline)."""
    quiet: int = 0

    def due(self, hook_s: float) -> tuple[int, str]:
        """How many link samples to take at this measurement (0, 1 or WINDOW), and why."""
        baseline = self.baseline
        if baseline is None:
            self.baseline, self.quiet = hook_s, 0
            return 0, f"new baseline: hook {1000 * hook_s:.1f} ms/step"
        if abs(hook_s - baseline) > max(self.band * baseline, self.floor_s):
            self.baseline = None
            return WINDOW, f"hook {1000 * baseline:.1f} -> {1000 * hook_s:.1f} ms/step"
        self.quiet += 1
        if self.quiet >= self.recheck:
            self.quiet = 0
            return 1, "periodic re-check"
        return 0, f"hook steady at {1000 * hook_s:.1f} ms/step"


def encode_seconds(
    method: Method,
    params: list[torch.Tensor],
    knobs: Knobs,
    world: int,
    own_group: dist.ProcessGroup | None = None,
    repeats: int = 2,
) -> float:
    """Seconds this rank spends compressing and decompressing one step's gradients with `method` (best of
    `repeats`, after an untimed run), with the link left out (:attr:`.method.Method.encoder`)."""
    if method.encoder is None:
        return 0.0
    bucket = LocalBucket(params)
    work = method.encoder(bucket, knobs, world, own_group)
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        collectives.synchronize(bucket.buffer().device)
        best = min(best, time.perf_counter() - start)
    return best


def time_link(group: dist.ProcessGroup | None, device: torch.device, line_up: bool = True) -> LinkSample:
    """Time a 4-byte and a :data:`PROBE_BYTES` all-reduce, after an untimed one that lines the ranks up unless
    `line_up` is False (the ranks have just finished another collective, which lines them up as well)."""
    small = torch.zeros(1, device=device)
    large = torch.zeros(PROBE_BYTES // 4, device=device)
    if line_up:
        dist.all_reduce(small, group=group)
        collectives.synchronize(device)
    timings = []
    for tensor in (small, large):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        collectives.synchronize(device)  # nccl only queues the collective on the stream
        timings.append(time.perf_counter() - start)
    return LinkSample.from_timings(timings[0], timings[1], PROBE_BYTES)


def link_samples(
    group: dist.ProcessGroup | None, device: torch.device, count: int, lined_up: bool = False
) -> list[LinkSample]:
    """`count` link samples (:func:`time_link`) back to back, the ranks lined up before the first unless `lined_up`;
    each the slowest rank's latency and seconds per byte: the same list on every rank."""
    if count == 0:
        return []
    timed = [time_link(group, device, line_up=i == 0 and not lined_up) for i in range(count)]
    flat = torch.tensor([v for t in timed for v in (t.latency_s, t.s_per_byte)], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    values = flat.tolist()
    return [LinkSample(values[i], values[i + 1]) for i in range(0, len(values), 2)]


SAMPLE_BYTES = 4 + PROBE_BYTES + 16
"""Bytes a link sample hands to collectives, the ranks already lined up: the two timed all-reduces and its two
float64 in the maximum."""


@dataclass
class _Dispatch:
    """State of the one hook DDP holds: the running method's state and hook, and residuals still to send."""

    method: Method
    state: Any
    hook: CommHook
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    hook_s: float = 0.0


def _dispatch(d: _Dispatch, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    carried = d.carry.pop(bucket.index(), None)
    if carried is not None and carried.shape == bucket.buffer().shape:
        bucket.buffer().add_(carried)
    start = time.perf_counter()

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        d.hook_s += time.perf_counter() - start
        return fut.value()

    return d.hook(d.state, bucket).then(done)


class AutoCompression(Compression):
    """The hook dispatcher, the measurements and the decisions of `compression = "auto"` on one rank."""

    def __init__(
        self, params: list[torch.Tensor], knobs: Knobs, candidates: Sequence[Method], group: dist.ProcessGroup | None
    ) -> None:
        super().__init__(CommCounter(), name=BASELINE)
        self.params, self.group, self.every = params, group, knobs.train.compression_auto_every_steps
        self.world = dist.get_world_size(group)
        self.is_root = dist.get_rank(group) == 0
        self.device = params[0].device
        self.warmup = knobs.warmup_steps
        # A method taking over mid-run needs no warm-up of its own (PowerSGD still all-reduces its first 2 steps).
        self.knobs = replace(knobs, warmup_steps=0)
        self.candidates = [m for m in candidates if m.refuses(params, self.knobs) is None]
        self.dispatch = self._start(next(m for m in self.candidates if m.name == BASELINE), {})
        self.policy, self.watch = Policy(self.world), LinkWatch()
        # Every rank creates every one-rank group, in the same order: PowerSGD's cost is timed on this rank's own.
        self.own_group = dist.new_subgroups(group_size=1, group=group)[0]
        self.steps = 0
        self.costs: list[Cost] | None = None
        self.compute: list[float] = []
        self.hooks: list[float] = []
        self.step_hook_s = self.probe_s = 0.0
        self.sampled: tuple[int, str] = (0, "")
        self.decisions: list[tuple[int, str]] = []
        """(step, method) of every measurement, on every rank: the same list on all of them."""
        self.last: Decision | None = None

    def after_step(self, model: nn.Module) -> None:
        """Count the step; at a measurement step, measure, decide on rank 0 and switch on every rank."""
        self.steps += 1
        self.name = self.dispatch.method.name  # the method that ran this step, whatever is decided now
        self.step_hook_s, self.dispatch.hook_s = self.dispatch.hook_s, 0.0
        self.probe_s = 0.0
        if self.steps > 1:
            self.hooks.append(self.step_hook_s)
        first = max(self.warmup, 2)  # step 1 includes DDP's bucket rebuild: not a compute sample
        if self.steps < first or (self.steps - first) % self.every:
            return
        start = time.perf_counter()
        self._decide()
        self.probe_s = time.perf_counter() - start

    def ran(self, seconds: float) -> None:
        """Account the step to its method and keep its compute time (wall less hook and measurement)."""
        super().ran(seconds)
        if self.steps > 1:
            self.compute.append(max(seconds - self.step_hook_s - self.probe_s, 0.0))

    def fields(self) -> dict[str, Any]:
        """The method that ran this step, and the decision made after it if there was one (with `probe_s`, the
        seconds its measurements and collectives took, and how many link samples it took and why)."""
        row: dict[str, Any] = {"compression": self.name}
        if self.last is not None and self.last.step == self.steps:
            count, why = self.sampled
            row["compression_decision"] = self.last.record() | {
                "probe_s": self.probe_s,
                "link_samples": count,
                "link_reason": why,
            }
        return row

    def _decide(self) -> None:
        first = self.costs is None
        if self.costs is None:
            encode = [encode_seconds(m, self.params, self.knobs, self.world, self.own_group) for m in self.candidates]
        else:
            encode = [c.encode_s for c in self.costs]
        compute = statistics.fmean(self.compute) if self.compute else 0.0
        hook = statistics.fmean(self.hooks) if self.hooks else 0.0
        self.compute, self.hooks = [], []
        # The slowest rank sets the pace: its times count, and every rank gates the link samples on the same numbers.
        slowest = torch.tensor([compute, hook, *encode], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        compute, hook, *encode = slowest.tolist()
        self.costs = [self._cost(m, e) for m, e in zip(self.candidates, encode, strict=True)]
        count, why = (WINDOW, "first measurement") if first else self.watch.due(hook)
        if count == WINDOW:
            self.policy.samples.clear()
        self.sampled = (count, why)
        # Every rank decides, on the same numbers (the slowest rank's), so they agree without a broadcast.
        samples = link_samples(self.group, self.device, count, lined_up=True)  # just after the maximum above
        self.last = self.policy.observe(self.steps, samples, compute, self.costs)
        if self.is_root:
            tqdm.write(f"{self.last.line()}; {count} link samples ({why})", file=sys.stderr)
        method = self.last.method
        self.decisions.append((self.steps, method))
        if method != self.dispatch.method.name:
            self.watch.baseline = None  # the new method's hook seconds are its own
            old = self.dispatch
            # The old method's unsent error feedback goes out with the new one's first step.
            new = next(m for m in self.candidates if m.name == method)
            self.dispatch = self._start(new, {**old.carry, **old.method.residuals(old.state)})

    def _cost(self, method: Method, encode_s: float) -> Cost:
        assert method.payload_bytes is not None, f"{method.name} is an auto candidate without a payload model"
        payload = method.payload_bytes(self.params, self.knobs)
        return Cost(method.name, payload, encode_s, method.rounds, method.gathers)

    def _start(self, method: Method, carry: dict[int, torch.Tensor]) -> _Dispatch:
        """A dispatcher running `method` from the next step on, sending `carry` with its first step."""
        assert method.hook is not None, f"{method.name} is an auto candidate without a hook"
        return _Dispatch(method, *method.hook(self.knobs, self.group, self.counter), carry=carry)


def install(
    model: DistributedDataParallel, knobs: Knobs, group: dist.ProcessGroup | None, methods: Sequence[Method]
) -> AutoCompression:
    """Register the dispatching hook on a DDP model (one bucket: `auto` blocks), choosing among the `methods`
    marked for it."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    auto = AutoCompression(params, knobs, [m for m in methods if m.auto], group)
    model.register_comm_hook(auto.dispatch, timed(auto.counter, _dispatch_current(auto)))
    return auto


def _dispatch_current(auto: AutoCompression) -> CommHook:
    """The registered hook: DDP keeps the state it was given, so it looks up the dispatcher running now."""

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _dispatch(auto.dispatch, bucket)

    return hook


METHOD = Method(
    name="auto",
    about="Measures the link, the compute and each method's encoding, and runs the method predicted fastest.",
    hook=None,
    warms_up=True,
    min_warmup_steps=2,  # it may run PowerSGD
    blocking=True,  # it may run PowerSGD, and switches methods on a fixed bucket layout
    install=install,
)
