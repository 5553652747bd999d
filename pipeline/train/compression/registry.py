"""The one list of compression methods, and what the rest of training asks of it.

`train.compression` accepts exactly the names here; `auto` chooses among the records marked for it; the docs' table
of methods is :func:`table`. A new method is one module exporting ``METHOD`` plus one line in :data:`MODULES`
(docs/architecture.md, "Where to add things").
"""

from __future__ import annotations

from types import ModuleType

from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import TrainConfig
from pipeline.errors import PipelineError
from pipeline.train.compression import (
    auto,
    bf16,
    diloco,
    fp16,
    localsgd,
    none,
    powersgd,
    sign,
    star,
    streaming,
    topk,
)
from pipeline.train.compression.method import Compression, Epoch, Knobs, Method, register

MODULES: tuple[ModuleType, ...] = (
    none,
    star,
    fp16,
    bf16,
    powersgd,
    topk,
    sign,
    localsgd,
    diloco,
    streaming,
    auto,
)
"""Every method's module, in the order the docs list them."""
METHODS: dict[str, Method] = {module.METHOD.name: module.METHOD for module in MODULES}
"""Every method by its `train.compression` name."""


def method(cfg: TrainConfig) -> Method:
    """The configured method; a PipelineError naming the known ones for any other name."""
    found = METHODS.get(cfg.compression)
    if found is None:
        raise PipelineError(f"train.compression: {cfg.compression!r} is not a method (one of: {', '.join(METHODS)})")
    return found


def check(cfg: TrainConfig) -> Method:
    """The configured method, after checking the settings it needs (the train stage calls this before any rank
    starts, so a bad value is one line, not a traceback per rank)."""
    chosen = method(cfg)
    steps = cfg.compression_warmup_steps
    if chosen.warms_up and steps is not None and steps < chosen.min_warmup_steps:
        raise PipelineError(
            f"train.compression_warmup_steps must be >= {chosen.min_warmup_steps} for {chosen.name} "
            "(its error feedback)"
        )
    if cfg.strategy == "fsdp" and not chosen.fsdp:
        fsdp = ", ".join(m.name for m in METHODS.values() if m.fsdp)
        raise PipelineError(f"train.compression {chosen.name!r} works with DDP only (fsdp: {fsdp})")
    return chosen


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int, done: int = 0) -> int:
    """Steps of plain all-reduce still due after `done` optimizer steps (a resumed run's): `compression_warmup_steps`
    if set, else `compression_warmup_epochs` of steps; never fewer than the method needs, also on resuming (PowerSGD's
    error feedback needs DDP's buckets rebuilt after the first step of the process, and starts again from zero)."""
    steps = cfg.compression_warmup_steps
    if steps is None:
        steps = round(cfg.compression_warmup_epochs * steps_per_epoch)
    return max(steps - done, 0, method(cfg).min_warmup_steps)


def knobs(cfg: TrainConfig, model: nn.Module, warmup: int, epoch: Epoch | None = None) -> Knobs:
    """What the configured method is set up from for `model`; a PipelineError if it cannot work on the model.
    `epoch` unset: epochs of `localsgd_period` steps (an averaging every period, from the first step's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = method(cfg)
    epoch = epoch or Epoch(cfg.localsgd_period)
    resolved = Knobs(cfg, sum(p.numel() for p in params), warmup if chosen.warms_up else 0, epoch)
    if why := chosen.refuses(params, resolved):
        raise PipelineError(f"train.compression {chosen.name!r}: {why}")
    return resolved


def install(
    model: DistributedDataParallel,
    cfg: TrainConfig,
    warmup: int,
    epoch: Epoch | None = None,
    group: ProcessGroup | None = None,
) -> Compression:
    """Register the configured method on a DDP model, with `warmup` steps of plain all-reduce still due (see
    :func:`warmup_steps`) and the steps falling into epochs as `epoch` says; return what counts and completes it."""
    chosen = method(cfg)
    resolved = knobs(cfg, model.module, warmup, epoch)
    if chosen.install is not None:
        return chosen.install(model, resolved, group, list(METHODS.values()))
    return register(chosen, model, resolved, group)


def table() -> str:
    """The docs' Markdown table of methods: name, what it sends, FSDP, warm-up and whether `auto` may choose it."""
    rows = ["| method | what it sends | FSDP | warm-up | `auto` may choose it |", "|---|---|---|---|---|"]
    for m in METHODS.values():
        dtype = str(m.reduce_dtype).removeprefix("torch.")
        fsdp = ("yes" if m.reduce_dtype is None else f"yes, {dtype} reduce-scatter") if m.fsdp else "DDP only"
        warm = "yes" if m.warms_up else "no"
        rows.append(f"| `{m.name}` | {m.about} | {fsdp} | {warm} | {'yes' if m.auto else 'no'} |")
    return "\n".join(rows) + "\n"
