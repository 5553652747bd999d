"""What `"auto"` training settings (`train.batch_size`, `train.epochs`, `train.lr`) become for the data at hand.

A fixed batch and epoch count cannot suit both the 1437 training digits and a folder of a hundred photographs:
64 images a step and 8 epochs give the digits 184 optimizer steps, and the photographs 16, after which a
torchvision model is still at chance. Like Lightning's and TAO's image-classification recipes, the budget that
matters is optimizer steps, so `auto` sizes the batch and the epochs from the training split: the digits keep
exactly their quickstart settings, and a small folder gets smaller batches and more passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipeline.config import TrainConfig
from pipeline.train.compression import registry
from pipeline.train.compression.method import Method

BATCH = 64
"""The batch `auto` starts from: what the quickstart's digits train with."""
MIN_STEPS_PER_EPOCH = 4
"""`auto` halves the batch while an epoch would have fewer optimizer steps than this: with 2 steps an epoch (a
hundred photos, batch 64) the learning-rate warm-up and the per-epoch BatchNorm recalibration see almost nothing."""
MIN_RANK_BATCH = 16
"""... but never below this many images per rank: BatchNorm normalises each rank's batch by its own statistics,
and below 16 images those are noisy enough to hurt (the reason torchvision's recipes keep 32 a GPU)."""
EPOCHS = 8
"""Fewest epochs `auto` gives: the quickstart's."""
MIN_STEPS = 120
"""`auto` adds epochs until training makes at least this many optimizer steps: small photo folders trained from
scratch stay near chance with fewer (docs/measurements.md#fewest-optimizer-steps)."""
SCRATCH_LR = 1e-2
"""AdamW's peak rate from scratch (with warm-up and cosine decay): what the quickstart trains with."""
FINETUNE_LR = 1e-3
"""... and from a weights file: a tenth, so that the first full-size steps, driven by a fresh head's large
gradients, do not overwrite what the weights already know (docs/measurements.md#fine-tuning-learning-rate)."""


@dataclass(frozen=True)
class Plan:
    """The batch, epochs and peak learning rate a run trains with, and why (one line per `auto` setting)."""

    batch_size: int
    epochs: int
    lr: float
    why: tuple[str, ...] = ()


def steps_per_epoch(train_size: int, batch_size: int, world_size: int) -> int:
    """Optimizer steps in one epoch: each rank's DistributedSampler share (padded up) in per-rank batches."""
    per_rank = max(batch_size // world_size, 1)
    return math.ceil(math.ceil(train_size / world_size) / per_rank)


def auto_batch(train_size: int, world_size: int) -> int:
    """64, halved while an epoch would have fewer than MIN_STEPS_PER_EPOCH steps, not below MIN_RANK_BATCH a rank,
    and never more than the training split holds (rounded down to a multiple of the ranks)."""
    batch, floor = BATCH, MIN_RANK_BATCH * world_size
    while batch // 2 >= floor and steps_per_epoch(train_size, batch, world_size) < MIN_STEPS_PER_EPOCH:
        batch //= 2
    return max(min(batch, train_size - train_size % world_size), world_size)


def scaled_epochs(planned: Plan, method: Method, why: str) -> Plan:
    """`planned` with its epochs times `method`'s epochs factor (`why` says what chose the method)."""
    epochs = planned.epochs * method.epochs_factor
    line = f"train.epochs {planned.epochs} -> {epochs}: {method.name}, {why}, averages models ({method.epochs_factor}x)"
    return replace(planned, epochs=epochs, why=(*planned.why, line))


def plan(train: TrainConfig, train_size: int, world_size: int, pretrained: bool) -> Plan:
    """Resolve `auto` in `train.batch_size`, `train.epochs` and `train.lr` for `train_size` training images on
    `world_size` ranks; `pretrained`: training starts from `model.weights`. Set values are kept as they are."""
    why: list[str] = []
    batch = train.batch_size
    if batch == "auto":
        batch = auto_batch(train_size, world_size)
        steps = MIN_STEPS_PER_EPOCH
        why.append(f"train.batch_size auto: {batch} (at least {steps} steps an epoch of {train_size} images)")
    epochs = train.epochs
    if epochs == "auto":
        steps = steps_per_epoch(train_size, batch, world_size)
        epochs = max(EPOCHS, math.ceil(MIN_STEPS / steps))
        line = f"at least {MIN_STEPS} optimizer steps, {steps} an epoch"
        if (factor := registry.method(train).epochs_factor) > 1:
            epochs *= factor
            line += f"; {factor}x that for {train.compression}, which averages models"
        why.append(f"train.epochs auto: {epochs} ({line})")
    lr = train.lr
    if lr == "auto":
        lr = FINETUNE_LR if pretrained else SCRATCH_LR
        why.append(f"train.lr auto: {lr:g} ({'from model.weights' if pretrained else 'from scratch'})")
    return Plan(batch, epochs, lr, tuple(why))
