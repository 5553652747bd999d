"""Gradient compression as DDP communication hooks, each counting the bytes it puts on the wire and the time it takes.

A method is a factory in :data:`HOOKS`: given its resolved :class:`Knobs`, the process group and a
:class:`CommCounter`, it returns the (state, hook) pair for ``DistributedDataParallel.register_comm_hook``. Each
counts its own payload, since only it knows what it sends. :func:`install` registers one and returns a
:class:`Compression`, whose :meth:`Compression.after_step` runs what a method does after the optimizer step (local
SGD's model averaging).

Gloo constraints shape the methods (docs/torch-distributed.md#powersgd-on-gloo, #all-gather-hooks-keyed-by-bucket):
PowerSGD waits for its own future before returning, so ranks issue
its P/Q all-reduces in the same order whatever the number of buckets; top-k and sign run one asynchronous all_gather
per bucket into buffers of their own and key their error feedback by bucket index (DDP rebuilds its buckets after the
first step).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import TrainConfig
from pipeline.errors import PipelineError

BLOCKING = ("powersgd", "auto")
"""Methods whose hook finishes its collectives before it returns: their round trips overlap nothing, so each extra
DDP bucket costs a few more of them per step (docs/measurements.md#blocking-hooks-and-ddp-buckets).
`auto` runs PowerSGD too, and switches between methods on a fixed bucket layout. Top-k and sign send each bucket
with one asynchronous all_gather, which overlaps the rest of the backward pass like DDP's own all-reduce."""
WARMING_METHODS = ("powersgd", "topk", "sign", "localsgd", "auto")
"""Methods that run plain all-reduce for `compression_warmup_epochs` (or `_steps`) before they start."""
TOPK_MIN_ENTRIES = 2048
"""Fewest entries `topk` sends by default: fewer lost a small CNN's accuracy
(docs/measurements.md#top-k-how-many-entries)."""
TOPK_FRACTIONS = (0.01, 0.1)
"""Range of the default `topk_fraction`: 1% for large models, 10% at most (docs/measurements.md, as above)."""
TOPK_SAMPLE_STRIDE = 100
"""`topk` sets its selection threshold from every 100th entry of a bucket (112 k of resnet18's 11.2 M gradients)."""
TOPK_OVERSELECT = 2.0
"""The threshold is aimed at keeping twice the k entries sent, so sampling noise rarely leaves fewer than k."""
SIGN_WHOLE_BELOW = 1024
"""`sign` sends tensors of fewer entries whole, besides vectors: a small model's stem and head as signs cost the
quickstart accuracy (docs/measurements.md#sign-what-goes-whole-and-one-scale-per-channel)."""
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
HookFactory = Callable[["Knobs", dist.ProcessGroup | None, "CommCounter"], tuple[Any, CommHook]]


@dataclass(frozen=True)
class Knobs:
    """A method's settings resolved for one model and one epoch length."""

    warmup_steps: int
    powersgd_rank: int
    topk_fraction: float
    localsgd_period: int
    localsgd_int8: bool = False


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int, done: int = 0) -> int:
    """Steps of plain all-reduce still due after `done` optimizer steps (a resumed run's): `compression_warmup_steps`
    if set, else `compression_warmup_epochs` of steps. At least 2 for PowerSGD, also on resuming: its error feedback
    needs DDP's buckets rebuilt after the first step of the process, and starts again from zero."""
    steps = cfg.compression_warmup_steps
    if steps is None:
        steps = round(cfg.compression_warmup_epochs * steps_per_epoch)
    steps = max(steps - done, 0)
    return max(steps, 2) if cfg.compression in ("powersgd", "auto") else steps


def default_topk_fraction(numel: int) -> float:
    """1% of the gradients, but at least :data:`TOPK_MIN_ENTRIES` of them and at most 10%."""
    low, high = TOPK_FRACTIONS
    return min(high, max(low, TOPK_MIN_ENTRIES / numel))


def powersgd_numel(shapes: list[torch.Size], rank: int) -> int:
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


def resolve(cfg: TrainConfig, model: nn.Module) -> Knobs:
    """The configured method's knobs for `model`; raises PipelineError for a method that cannot work on it.

    `cfg.compression_warmup_steps` must be resolved already (:func:`warmup_steps`) for the warming methods.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    steps = cfg.compression_warmup_steps
    if steps is None:
        if cfg.compression in WARMING_METHODS:
            raise ValueError("compression_warmup_steps must be resolved with warmup_steps() before install")
        steps = 0
    fraction = cfg.topk_fraction if cfg.topk_fraction is not None else default_topk_fraction(numel)
    if cfg.compression == "powersgd" and powersgd_numel([p.shape for p in params], cfg.powersgd_rank) >= numel:
        raise PipelineError(
            f"train.compression 'powersgd': no weight matrix of this model is large enough for rank "
            f"{cfg.powersgd_rank} to shrink it; use topk or sign"
        )
    return Knobs(steps, cfg.powersgd_rank, fraction, cfg.localsgd_period, cfg.localsgd_int8)


_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
_SIGNS_OF_BYTE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _BIT_SHIFTS) & 1).float() * 2 - 1
"""The eight ±1.0 a packed byte stands for: unpacking is one lookup per byte (twice as fast as shifting bits)."""


@dataclass
class CommCounter:
    """Bytes of gradient (or, for local SGD, parameter) payload this rank handed to collectives, and the seconds
    they took, since the last :meth:`take`.

    The payload, not the algorithm's traffic: a ring all-reduce moves about 2(n-1)/n times this over the links,
    the same factor for every method, so the counter compares methods fairly. The seconds run from handing a
    bucket to the method until its averaged gradient is back (compression included), summed over buckets; for
    asynchronous methods they overlap the backward pass.
    """

    bytes: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int = 0, seconds: float = 0.0) -> None:
        """Record a payload or a duration; safe from the gloo threads that complete futures."""
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds

    def take(self) -> tuple[int, float]:
        """Return (bytes, seconds) and reset both (called once per optimizer step)."""
        with self._lock:
            taken = (self.bytes, self.seconds)
            self.bytes, self.seconds = 0, 0.0
        return taken


@dataclass
class _CountingState:
    group: dist.ProcessGroup | None
    counter: CommCounter


def _timed(counter: CommCounter, hook: CommHook) -> CommHook:
    """Wrap a hook so the time until its future completes is added to the counter."""

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            counter.add(seconds=time.perf_counter() - start)
            return fut.value()

        return hook(state, bucket).then(done)

    return timed


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class _Steps:
    """Optimizer steps seen by a hook: DDP calls the last bucket (`is_last`) once per synchronised step."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.done = warmup, 0

    def warming(self) -> bool:
        """True while plain all-reduce is still due."""
        return self.done < self.warmup

    def tick(self, bucket: dist.GradBucket) -> None:
        """Count a step when its last bucket passes."""
        if bucket.is_last():
            self.done += 1


def _stock(inner: Callable[..., torch.futures.Future[torch.Tensor]], wire: torch.dtype | None) -> HookFactory:
    """Wrap a stock torch hook that takes (process_group, bucket): count numel * wire element size, then delegate."""

    def factory(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        def hook(state: _CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            state.counter.add(buffer.numel() * (wire or buffer.dtype).itemsize)
            return inner(state.group, bucket)

        return _CountingState(group, counter), hook

    return factory


def _powersgd(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=knobs.powersgd_rank,
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
        # gloo: its P/Q all-reduces start from callbacks; waiting keeps every rank's order the same
        # (docs/torch-distributed.md#powersgd-on-gloo).
        fut.wait()
        return fut

    return state, hook


@dataclass
class _SparseState:
    """Error feedback per bucket index (reset when DDP rebuilds a bucket with a different size) and a step count."""

    group: dist.ProcessGroup | None
    counter: CommCounter
    steps: _Steps
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    def corrected(self, bucket: dist.GradBucket) -> torch.Tensor:
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
        out = [torch.empty_like(payload) for _ in range(dist.get_world_size(self.group))]
        work = dist.all_gather(out, payload, group=self.group, async_op=True)
        return work.get_future().then(lambda _: decode(out))


Compressor = Callable[[_SparseState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def _sparse(compress: Compressor) -> HookFactory:
    """An all_gather-based method with error feedback, plain all-reduce during warm-up."""

    def factory(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        def hook(state: _SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if state.steps.warming():
                state.steps.tick(bucket)
                state.counter.add(bucket.buffer().numel() * bucket.buffer().element_size())
                return default_hooks.allreduce_hook(state.group, bucket)
            state.steps.tick(bucket)
            return compress(state, bucket)

        return _SparseState(group, counter, _Steps(knobs.warmup_steps)), hook

    return factory


def topk_size(numel: int, fraction: float) -> int:
    """Entries top-k sends for a bucket of `numel` gradients: at least one."""
    return max(1, math.ceil(numel * fraction))


def largest(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest entries of the 1-D `magnitude`: the same set as `magnitude.topk(k)`, found faster.

    On a CPU, `topk` over a whole bucket dominated top-k's encoding (0.31 s for resnet18's 11.2 M gradients on one
    thread, over half of a forward and backward pass). A threshold read off every `TOPK_SAMPLE_STRIDE`-th entry
    keeps about `TOPK_OVERSELECT` times k candidates, a superset of the k largest whenever it keeps at least k, and
    `topk` runs on those alone (0.07 s); a threshold that keeps fewer falls back to the full `topk`. Setting the
    threshold from a sample is Deep Gradient Compression's (Lin et al., ICLR 2018, system performance analysis);
    here it only narrows the search, so the result is exact. On a GPU `topk` is fast already, and the candidates'
    count would make the hook wait for the device, so there it runs on the whole bucket.
    """
    n = magnitude.numel()
    sample = magnitude[::TOPK_SAMPLE_STRIDE]
    above = math.ceil(TOPK_OVERSELECT * k * sample.numel() / n)
    # A threshold narrows nothing when k is a large share of the bucket.
    if magnitude.device.type != "cpu" or above >= sample.numel():
        return magnitude.topk(k, sorted=False).indices
    threshold = sample.topk(above, sorted=False).values.min()
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def _topk(fraction: float) -> Compressor:
    def compress(state: _SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        corrected = state.corrected(bucket)
        k = topk_size(corrected.numel(), fraction)
        index = largest(corrected.abs(), k)
        values = corrected[index]
        corrected[index] = 0.0
        state.residuals[bucket.index()] = corrected
        # One collective: the int32 indices travel bit-for-bit inside the fp32 payload.
        payload = torch.cat([values.float(), index.to(torch.int32).view(torch.float32)])

        def decode(parts: list[torch.Tensor]) -> torch.Tensor:
            dense = torch.zeros_like(corrected)
            for part in parts:
                dense.index_add_(0, part[k:].view(torch.int32).long(), part[:k].to(dense.dtype))
            return dense.div_(len(parts))

        return state.gather(payload, decode)

    return compress


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """1 bit per element (1 for >= 0), 8 to a byte, most significant first; padded with ones."""
    bits = tensor.flatten() >= 0
    bits = torch.cat([bits, bits.new_ones((-bits.numel()) % 8)]).view(-1, 8).view(torch.uint8)
    return (bits << _BIT_SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """±1.0 per element from :func:`pack_signs` output."""
    return _SIGNS_OF_BYTE.to(packed.device).index_select(0, packed.long()).flatten()[:numel]


def row_scales(segments: list[torch.Tensor], shapes: list[torch.Size]) -> torch.Tensor:
    """The mean magnitude of each row (output channel: the first dimension) of each tensor, in fp32."""
    rows = [seg.view(shape[0], -1).abs().mean(1) for seg, shape in zip(segments, shapes, strict=True)]
    return torch.cat(rows).float()


def scaled_signs(packed: torch.Tensor, scales: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
    """Each tensor's unpacked signs times its rows' scales (:func:`row_scales`), multiplied in place tensor by tensor
    (a `repeat_interleave` of the scales cost as much as the rest of sign's arithmetic on resnet18)."""
    sizes = [shape.numel() for shape in shapes]
    signs = unpack_signs(packed, sum(sizes))
    for segment, shape, scale in zip(signs.split(sizes), shapes, scales.split([s[0] for s in shapes]), strict=True):
        segment.view(shape[0], -1).mul_(scale.unsqueeze(1))
    return signs


def sends_whole(param: torch.Tensor) -> bool:
    """Whether `sign` sends this parameter's gradient as it is rather than as signs: vectors (biases, norm scales
    and shifts, which torch's PowerSGD hook leaves uncompressed too:
    docs/torch-distributed.md#vectors-and-rows-in-compression) and tensors of fewer than `SIGN_WHOLE_BELOW` entries."""
    return param.dim() <= 1 or param.numel() < SIGN_WHOLE_BELOW


def sign_size(params: list[torch.Tensor]) -> int:
    """Bytes sign sends for a bucket of these parameters: the packed bits and an fp32 scale per row of each signed
    tensor, and the tensors it sends whole at their own dtype."""
    signed = [p for p in params if not sends_whole(p)]
    whole = sum(p.numel() * p.element_size() for p in params if sends_whole(p))
    return math.ceil(sum(p.numel() for p in signed) / 8) + 4 * sum(p.shape[0] for p in signed) + whole


def _partition(segments: tuple[torch.Tensor, ...], whole: list[bool]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A bucket's per-tensor segments split into those sent as signs and those sent whole, each in bucket order."""
    pairs = list(zip(segments, whole, strict=True))
    return [seg for seg, w in pairs if not w], [seg for seg, w in pairs if w]


def _sign(state: _SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    corrected = state.corrected(bucket)
    params = bucket.parameters()
    whole = [sends_whole(p) for p in params]
    segments = corrected.split([p.numel() for p in params])
    signed, kept = _partition(segments, whole)
    shapes = [p.shape for p, w in zip(params, whole, strict=True) if not w]
    sizes, kept_sizes = [seg.numel() for seg in signed], [seg.numel() for seg in kept]
    exact = torch.cat(kept) if kept else corrected.new_empty(0)
    # A scale per output channel (PowerSGD's rows: docs/torch-distributed.md#vectors-and-rows-in-compression).
    # Gradients differ by orders of magnitude between layers and between a layer's channels, so one scale per tensor
    # loses accuracy (docs/measurements.md#sign-what-goes-whole-and-one-scale-per-channel).
    scales = row_scales(signed, shapes) if signed else corrected.new_empty(0).float()
    packed = pack_signs(torch.cat(signed) if signed else corrected.new_empty(0))
    for seg, sent in zip(signed, scaled_signs(packed, scales, shapes).split(sizes), strict=True):
        seg.sub_(sent)
    for seg in kept:
        seg.zero_()
    state.residuals[bucket.index()] = corrected  # what the signs did not carry
    lengths = [packed.numel(), 4 * scales.numel(), exact.numel() * exact.element_size()]

    def decode(parts: list[torch.Tensor]) -> torch.Tensor:
        mean = torch.zeros_like(corrected)
        out_signed, out_kept = _partition(mean.split([seg.numel() for seg in segments]), whole)
        for part in parts:
            bits, their_scales, their_exact = part.split(lengths)
            got = scaled_signs(bits, their_scales.clone().view(torch.float32), shapes).split(sizes)
            got_kept = their_exact.clone().view(corrected.dtype).split(kept_sizes)
            for seg, value in zip(out_signed + out_kept, got + got_kept, strict=True):
                seg.add_(value)
        return mean.div_(len(parts))

    payload = torch.cat([packed, scales.view(torch.uint8), exact.view(torch.uint8)])
    return state.gather(payload, decode)


def _localsgd(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
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


def _bound(factory: Callable[[float], Compressor]) -> HookFactory:
    def make(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        return _sparse(factory(knobs.topk_fraction))(knobs, group, counter)

    return make


HOOKS: dict[str, HookFactory] = {
    "none": _stock(default_hooks.allreduce_hook, None),
    "fp16": _stock(default_hooks.fp16_compress_hook, torch.float16),
    "bf16": _stock(default_hooks.bf16_compress_hook, torch.bfloat16),
    "powersgd": _powersgd,
    "topk": _bound(_topk),
    "sign": _sparse(_sign),
    "localsgd": _localsgd,
}


class Int8DeltaAverager:
    """Local SGD's periodic averaging in 8 bits: each rank sends how far each tensor moved since the last average
    (its anchor, the same on every rank), quantised to int8 with one fp32 scale per tensor, keeping the rounding
    error for the next averaging (error feedback). Every rank sums the same gathered payloads in the same order, so
    the averaged parameters are identical on all. The first averaging, with no anchor yet, is in fp32."""

    def __init__(self, period: int, warmup_steps: int, group: dist.ProcessGroup | None = None) -> None:
        self.period, self.warmup_steps, self.group, self.step = period, warmup_steps, group, 0
        self.anchor: list[torch.Tensor] = []
        self.residual: list[torch.Tensor] = []
        self.sent = 0
        """Bytes the last averaging handed to collectives."""

    def average_parameters(self, params: list[torch.Tensor]) -> None:
        """Average when due (as PeriodicModelAverager: after warm-up, every `period` steps), then count the step."""
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            self._average(params)
        self.step += 1

    @torch.no_grad()
    def _average(self, params: list[torch.Tensor]) -> None:
        world = dist.get_world_size(self.group)
        if not self.anchor:
            flat = torch.cat([p.flatten() for p in params]).div_(world)
            dist.all_reduce(flat, group=self.group)
            for p, avg in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.copy_(avg.view_as(p))
            self.anchor = [p.detach().clone() for p in params]
            self.residual = [torch.zeros_like(p) for p in params]
            self.sent = flat.numel() * flat.element_size()
            return
        deltas = [p - a + r for p, a, r in zip(params, self.anchor, self.residual, strict=True)]
        scales = torch.stack([d.abs().max() for d in deltas]).float().div_(127).clamp_(min=1e-30)
        quantised = [d.div(s).round_().clamp_(-127, 127).to(torch.int8) for d, s in zip(deltas, scales, strict=True)]
        self.residual = [d - q.to(d.dtype) * s for d, q, s in zip(deltas, quantised, scales, strict=True)]
        payload = torch.cat([torch.cat([q.flatten() for q in quantised]), scales.view(torch.int8)])
        parts = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(parts, payload, group=self.group)
        self.sent = payload.numel()
        n = payload.numel() - scales.numel() * 4
        mean = [torch.zeros_like(a) for a in self.anchor]
        for part in parts:
            their_scales = part[n:].clone().view(torch.float32)
            for m, q, s in zip(mean, part[:n].split([a.numel() for a in self.anchor]), their_scales, strict=True):
                m.add_(q.view_as(m).to(m.dtype) * s)
        for p, a, m in zip(params, self.anchor, mean, strict=True):
            p.copy_(a + m.div_(world))
            a.copy_(p)


class Compression:
    """An installed method: its counter, and what it does after each optimizer step."""

    timed = True
    """Whether the counter's seconds are measured (False: `comm_s` is logged as null)."""

    def __init__(
        self,
        counter: CommCounter,
        averager: PeriodicModelAverager | Int8DeltaAverager | None = None,
        name: str = "",
    ) -> None:
        self.counter = counter
        self.averager = averager
        self.name = name
        self.seconds: dict[str, float] = {}
        """Wall seconds of the steps each method ran (the summary's `compression_seconds`)."""

    def after_step(self, model: nn.Module) -> None:
        """Local SGD: average the parameters across ranks every `period` steps after warm-up, counting the bytes."""
        avg = self.averager
        if avg is None:
            return
        due = avg.step >= avg.warmup_steps and (avg.step - avg.warmup_steps) % avg.period == 0
        params = [p for p in model.parameters() if p.requires_grad]
        start = time.perf_counter()
        avg.average_parameters(params)
        if due:
            full = sum(p.numel() * p.element_size() for p in params)
            sent = avg.sent if isinstance(avg, Int8DeltaAverager) else full
            self.counter.add(sent, time.perf_counter() - start)

    def ran(self, seconds: float) -> None:
        """Account a finished step's wall time to the method that ran it."""
        self.seconds[self.name] = self.seconds.get(self.name, 0.0) + seconds

    def fields(self) -> dict[str, Any]:
        """What the step's metrics line records about compression: the method that ran it."""
        return {"compression": self.name}


def install(model: DistributedDataParallel, cfg: TrainConfig, group: dist.ProcessGroup | None = None) -> Compression:
    """Register the configured compression hook on a DDP model and return what counts and completes it."""
    knobs = resolve(cfg, model.module)
    if cfg.compression == "auto":
        # auto builds on this module's hooks: imported here, where both are loaded.
        from pipeline.train.compression import auto_compression

        return auto_compression.install(model, cfg, knobs, group)
    counter = CommCounter()
    state, hook = HOOKS[cfg.compression](knobs, group, counter)
    model.register_comm_hook(state, _timed(counter, hook))
    averager: PeriodicModelAverager | Int8DeltaAverager | None = None
    if cfg.compression == "localsgd":
        kind = Int8DeltaAverager if knobs.localsgd_int8 else PeriodicModelAverager
        averager = kind(knobs.localsgd_period, knobs.warmup_steps, group)
    return Compression(counter, averager, cfg.compression)
