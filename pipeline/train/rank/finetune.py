"""Starting from a weights file: which parameters `model.freeze` holds still, and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Literal

from torch import nn

import models
from pipeline.errors import PipelineError
from pipeline.train.rank.strategy import blocks

Freeze = Literal["none", "backbone"] | int


def frozen_names(model: nn.Module, name: str, freeze: Freeze) -> set[str]:
    """Names of the parameters `freeze` holds still: none; every one outside the classifier head (`backbone`);
    or those of the first N blocks (the units FSDP shards, in order: the stem first)."""
    if freeze in ("none", 0):
        return set()
    if freeze == "backbone":
        head = models.spec_for(name).head
        return {n for n, _ in model.named_parameters() if not n.startswith(head)}
    assert isinstance(freeze, int)
    units = blocks(model)
    if freeze >= len(units):
        raise PipelineError(f"model.freeze: {freeze} blocks would freeze all of {name}'s {len(units)}: nothing trains")
    held = {id(p) for unit in units[:freeze] for p in unit.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in held}


def scheduled_lr(peak: float, step: int, total: int, warmup: int = 0) -> float:
    """Learning rate for `step` (0-based) of `total`: linear warm-up over the first `warmup` steps to `peak`, then
    cosine decay towards zero over the rest.

    A pure function of the step, so a resumed run continues the schedule without any saved scheduler state.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
