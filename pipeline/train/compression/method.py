"""What a compression method is: one :class:`Method` record, and what every method shares.

A method module (``none.py``, ``topk.py``, …) exports one record, ``METHOD``; :mod:`.registry` lists them. The record
says everything the rest of training asks of a method: its DDP communication hook, whether that hook blocks, its
warm-up, whether FSDP can use it and in which reduce dtype, its payload and collectives (what ``auto`` predicts from),
how to time its encoding, and what runs after the optimizer step. Code outside the method reads only these fields.

A hook counts its own payload in a :class:`CommCounter`, since only it knows what it sends; :class:`Compression` is
an installed method: the counter, and what it does after each optimizer step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as live objects (GradBucket, Future).
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import TrainConfig

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class Epoch:
    """How the optimizer steps fall into epochs, for the averagings lined up with them (:class:`.localsgd.Schedule`)."""

    steps: int
    """Optimizer steps an epoch."""
    done: int = 0
    """Steps of the current epoch taken before the method was set up (a resume mid-epoch)."""


@dataclass(frozen=True)
class Knobs:
    """What a method is set up from: the user's train settings, the model's size, the warm-up still due and the
    epoch's steps."""

    train: TrainConfig
    """The run's `train` table (each method reads its own settings: `powersgd_rank`, `topk_fraction`, …)."""
    numel: int
    """Trainable entries of the model (the scale some defaults follow)."""
    warmup_steps: int
    """Steps of plain all-reduce still due before the method starts (computed for this run; see registry)."""
    epoch: Epoch
    """Where the steps fall in epochs."""


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


class Timetable(Protocol):
    """When an averager averages (:class:`.localsgd.Schedule`), as the trainer reads it."""

    in_sync: bool
    """Whether the ranks' models are one now: in the warm-up and right after an averaging."""
    whole: bool
    """Whether an averaging makes the models one (local SGD, DiLoCo: a checkpoint due waits for the next); False
    where none does (streaming, one fragment at a time: a checkpoint due settles them at once)."""
    averaged: bool
    """Whether the step just counted ended with an averaging that made the models one (not a warm-up step, whose
    models DDP keeps one)."""


class Averager(Protocol):
    """What a method runs after each optimizer step (local SGD's model averaging)."""

    schedule: Timetable
    """When it averages."""

    def average(self, params: list[torch.Tensor]) -> int:
        """Average `params` across ranks when due; the bytes handed to collectives (0 when not due)."""
        ...

    def settle(self, params: list[torch.Tensor]) -> int:
        """Average now, unless the ranks' models are already one (warm-up, or the last step averaged them); the
        bytes handed to collectives."""
        ...


@runtime_checkable
class Paced(Protocol):
    """A timetable under which a slow rank may train only some of the steps, its change weighed by the steps it
    trained (:class:`.localsgd.Schedule`): no collective runs between averagings, so none waits for a skipped step."""

    def pace(self, paces: list[float]) -> None:
        """From the next step, rank r trains `paces[r]` of the steps."""
        ...

    def trains(self, rank: int) -> bool:
        """Whether `rank` trains at the next step."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """An averager with state of its own that a checkpoint must keep (DiLoCo's outer momentum)."""

    def state(self, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors to save, the same on every rank; those a resume loads into, in place."""
        ...

    def restore(self, params: list[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Go on from a checkpoint of settled `params` whose :meth:`state` was loaded into `state`."""
        ...


class Bucket(Protocol):
    """The parts of DDP's GradBucket a method reads (a :class:`LocalBucket` stands in when timing an encoder)."""

    def buffer(self) -> torch.Tensor:
        """The bucket's gradients, flat."""
        ...

    def index(self) -> int:
        """Its position in DDP's bucket order."""
        ...

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients it holds, in order."""
        ...

    def is_last(self) -> bool:
        """Whether it is the step's last bucket."""
        ...


HookFactory = Callable[[Knobs, dist.ProcessGroup | None, CommCounter], tuple[Any, CommHook]]
"""(knobs, process group, counter) → the (state, hook) pair for ``DistributedDataParallel.register_comm_hook``."""
AveragerFactory = Callable[[Knobs, dist.ProcessGroup | None], Averager]
PayloadModel = Callable[[list[torch.Tensor], Knobs], int]
"""Bytes handed to collectives per step for these parameters in one bucket (fp32 gradients), after warm-up."""
EncoderFactory = Callable[[Bucket, Knobs, int, dist.ProcessGroup | None], Callable[[], object]]
"""(bucket, knobs, world size, a group of this rank alone) → one step of compressing and decompressing the bucket,
communicating nothing (a gather decodes `world` copies of this rank's payload)."""
Refusal = Callable[[list[torch.Tensor], Knobs], str | None]
"""Why the method cannot work on a model with these parameters, or None."""
Installer = Callable[[DistributedDataParallel, Knobs, dist.ProcessGroup | None, Sequence["Method"]], "Compression"]
"""(DDP model, knobs, group, every registered method) → the installed method, for one that drives DDP's hook itself."""


def _never(params: list[torch.Tensor], knobs: Knobs) -> str | None:
    return None


def _nothing_held(state: Any) -> dict[int, torch.Tensor]:
    return {}


@dataclass(frozen=True)
class Method:
    """A compression method: its hook and every fact the rest of training reads about it."""

    name: str
    """The `train.compression` value."""
    about: str
    """One sentence for the docs' table of methods."""
    hook: HookFactory | None
    """Its DDP communication hook (None only for a method with an :attr:`install` of its own)."""
    warms_up: bool
    """Whether it runs plain all-reduce for `compression_warmup_epochs` (or `_steps`) before it starts."""
    min_warmup_steps: int = 0
    """Fewest warm-up steps it needs, also on resuming (PowerSGD's error feedback: DDP's buckets rebuilt first)."""
    blocking: bool = False
    """Whether its hook finishes its collectives before returning: then each extra DDP bucket adds round trips that
    overlap nothing, so DDP gets one bucket (docs/measurements.md#blocking-hooks-and-ddp-buckets)."""
    fsdp: bool = False
    """Whether FSDP can use it: as a cast of its reduce-scatter to :attr:`reduce_dtype` (the others hook DDP)."""
    reduce_dtype: torch.dtype | None = None
    """FSDP's reduce-scatter dtype (None: the parameters' own)."""
    payload_bytes: PayloadModel | None = None
    """Its payload per step after warm-up (what `auto` predicts from; None: not modelled)."""
    rounds: int = 1
    """Collectives it runs one after the other per step (each costs a round trip's latency)."""
    gathers: bool = False
    """Whether it all_gathers (each rank receives (n - 1)·p bytes) rather than all-reduces (2(n - 1)/n·p)."""
    encoder: EncoderFactory | None = None
    """How `auto` times its compressing and decompressing (None: it sends the gradient as it is)."""
    residuals: Callable[[Any], dict[int, torch.Tensor]] = _nothing_held
    """What its hook state holds as error feedback per bucket index, unsent: carried into the next method when
    `auto` switches."""
    auto: bool = False
    """Whether `auto` may switch to it at any step (a gradient hook; not local SGD, which averages models)."""
    exact: bool = False
    """Whether the average it gives is the gradient's own, up to a cast to 16 bits: an epoch learns what plain
    all-reduce's does. `auto` weighs DiLoCo against these alone (:mod:`.autoplan`)."""
    after_step: AveragerFactory | None = None
    """What runs after each optimizer step (local SGD's averaging)."""
    epochs_factor: int = 1
    """`train.epochs = "auto"` gives it this many times the epochs it gives the others: averaging models every few
    steps learns less an epoch than averaging every gradient, and where it pays off (a slow link) its epochs cost a
    fraction of theirs (docs/measurements.md#diloco-epochs-and-defaults)."""
    refuses: Refusal = _never
    """Why it cannot work on a model, checked before training."""
    install: Installer | None = None
    """Installs a method that drives DDP's hook itself (`auto`), instead of registering :attr:`hook`."""


class Compression:
    """An installed method: its counter, and what it does after each optimizer step."""

    timed = True
    """Whether the counter's seconds are measured (False: `comm_s` is logged as null)."""

    def __init__(self, counter: CommCounter, name: str, averager: Averager | None = None) -> None:
        self.counter = counter
        self.name = name
        self.averager = averager
        self.seconds: dict[str, float] = {}
        """Wall seconds of the steps each method ran (the summary's `compression_seconds`)."""

    def after_step(self, model: nn.Module) -> None:
        """Run the method's averager, if any, counting what it sent and how long it took."""
        if self.averager is None:
            return
        start = time.perf_counter()
        sent = self.averager.average([p for p in model.parameters() if p.requires_grad])
        if sent:
            self.counter.add(sent, time.perf_counter() - start)

    def settle(self, model: nn.Module) -> int:
        """Make every rank's model the same before it is validated and saved: the models of a method that
        averages them every few steps differ in between, and each rank validates its own share of the images and
        saves its own share of the tensors (DCP), so without this the accuracy and the checkpoint would be a
        blend of different models. Returns the bytes sent (0 for the gradient methods, always in sync)."""
        if self.averager is None:
            return 0
        return self.averager.settle([p for p in model.parameters() if p.requires_grad])

    def in_sync(self) -> bool:
        """Whether every rank's model is the same now: always under the gradient methods; under a method that averages
        models every few steps, in its warm-up and right after an averaging."""
        return self.averager is None or self.averager.schedule.in_sync

    def ready_to_save(self, model: nn.Module) -> bool:
        """Whether a checkpoint due mid-epoch can be taken now: the models are one, or the method's averagings never
        make them one (:attr:`Timetable.whole`), so they are settled now (the bytes count in the next step's)."""
        if self.averager is not None and not self.averager.schedule.in_sync and not self.averager.schedule.whole:
            self.counter.add(self.settle(model))
        return self.in_sync()

    @property
    def averages_whole(self) -> bool:
        """Whether the method averages models every few steps, each averaging making them one (local SGD, DiLoCo)."""
        return self.averager is not None and self.averager.schedule.whole

    @property
    def averaged(self) -> bool:
        """Whether the step just taken ended with an averaging that made the models one (:attr:`Timetable.averaged`)."""
        return self.averager is not None and self.averager.schedule.averaged

    @property
    def paced(self) -> bool:
        """Whether a slow rank may train only some of the steps (:class:`Paced`)."""
        return self.averager is not None and isinstance(self.averager.schedule, Paced)

    def pace(self, paces: list[float]) -> None:
        """From the next step, rank r trains `paces[r]` of the steps (:attr:`paced` methods only)."""
        assert self.averager is not None and isinstance(self.averager.schedule, Paced)
        self.averager.schedule.pace(paces)

    def trains(self, rank: int) -> bool:
        """Whether `rank` trains at the next step: always, but under a :attr:`paced` method that paces it."""
        schedule = self.averager.schedule if self.averager is not None else None
        return not isinstance(schedule, Paced) or schedule.trains(rank)

    def outer_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the averager's own state: {} but for an averager that has one (DiLoCo's)."""
        if not isinstance(self.averager, Stateful):
            return {}
        return self.averager.state([p for p in model.parameters() if p.requires_grad])

    def restore_outer(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Give the averager back the state a checkpoint kept (:meth:`outer_state`, loaded)."""
        if isinstance(self.averager, Stateful) and state:
            self.averager.restore([p for p in model.parameters() if p.requires_grad], state)

    def ran(self, seconds: float) -> None:
        """Account a finished step's wall time to the method that ran it."""
        self.seconds[self.name] = self.seconds.get(self.name, 0.0) + seconds

    def fields(self) -> dict[str, Any]:
        """What the step's metrics line records about compression: the method that ran it."""
        return {"compression": self.name}


def register(
    method: Method, model: DistributedDataParallel, knobs: Knobs, group: dist.ProcessGroup | None
) -> Compression:
    """Register `method`'s hook on a DDP model, timed, with its averager; return the installed method."""
    assert method.hook is not None, f"{method.name} has no hook"
    counter = CommCounter()
    state, hook = method.hook(knobs, group, counter)
    model.register_comm_hook(state, timed(counter, hook))
    averager = method.after_step(knobs, group) if method.after_step else None
    return Compression(counter, method.name, averager)


def timed(counter: CommCounter, hook: CommHook) -> CommHook:
    """Wrap a hook so the time until its future completes is added to the counter."""

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            counter.add(seconds=time.perf_counter() - start)
            return fut.value()

        return hook(state, bucket).then(done)

    return timed_hook


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds `tensor`."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def cast(
    name: str, about: str, inner: Callable[..., torch.futures.Future[torch.Tensor]], dtype: torch.dtype, **facts: Any
) -> Method:
    """A method that sends the gradient cast to `dtype` with torch's stock hook `inner`: no warm-up (nothing is lost
    but precision), and FSDP can reduce-scatter in `dtype`. `facts`: the record's other fields."""
    return Method(
        name=name,
        about=about,
        hook=stock(inner, dtype),
        warms_up=False,
        fsdp=True,
        reduce_dtype=dtype,
        payload_bytes=lambda params, knobs: dtype.itemsize * sum(p.numel() for p in params),
        exact=True,
        **facts,
    )


@dataclass
class CountingState:
    """Hook state of a stock torch hook: its process group, and the counter the wrapper adds its payload to."""

    group: dist.ProcessGroup | None
    counter: CommCounter


def stock(inner: Callable[..., torch.futures.Future[torch.Tensor]], wire: torch.dtype | None) -> HookFactory:
    """A stock torch hook that takes (process_group, bucket), counting numel x `wire`'s element size (None: the
    gradient's own)."""

    def factory(knobs: Knobs, group: dist.ProcessGroup | None, counter: CommCounter) -> tuple[Any, CommHook]:
        def hook(state: CountingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            state.counter.add(buffer.numel() * (wire or buffer.dtype).itemsize)
            return inner(state.group, bucket)

        return CountingState(group, counter), hook

    return factory


def allreduce(group: dist.ProcessGroup | None, counter: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future:
    """Plain all-reduce of a bucket (a method's warm-up), counted."""
    counter.add(bucket.buffer().numel() * bucket.buffer().element_size())
    return default_hooks.allreduce_hook(group, bucket)


class LocalBucket:
    """A GradBucket of these parameters with random gradients, for timing an encoder without DDP."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._buffer = torch.randn(sum(p.numel() for p in params), device=params[0].device)

    def buffer(self) -> torch.Tensor:
        """The flat gradient."""
        return self._buffer

    def index(self) -> int:
        """The one bucket's index."""
        return 0

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds."""
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        """Views of the flat gradient shaped as the parameters (torch's PowerSGD hook reads them)."""
        sizes = [p.numel() for p in self._params]
        return [g.view_as(p) for g, p in zip(self._buffer.split(sizes), self._params, strict=True)]

    def is_last(self) -> bool:
        """The one bucket is the last."""
        return True
