"""BatchNorm running statistics that match the weights, and a check that they do.

Running statistics follow the weights with a lag: each step mixes in the batch's statistics with the layer's
momentum, 0.1 by default and 0.01 in torchvision's MobileNetV3. After a few hundred steps on a small dataset the
running statistics still describe the weights of long ago, and an eval-mode forward, which uses them, predicts one
class for everything while the same weights with batch statistics are right. Recomputing them over the training
data with the final weights, as `torch.optim.swa_utils.update_bn` does, makes eval-mode accuracy what the weights
can do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import islice

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipeline.train.compression import collectives

GAP_WARNING = 0.2
"""Eval-mode accuracy this far below train-mode accuracy on the same images is reported as a warning."""

Autocast = Callable[[], AbstractContextManager[object]]


def norms(model: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers that keep running statistics."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


@torch.no_grad()
def recalibrate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    batches: int,
    device: torch.device,
    autocast: Autocast,
    pieces: int = 1,
) -> int:
    """Reset every BatchNorm's running statistics and recompute them as the cumulative average over the first
    `batches` batches of `loader`, then average them over all ranks. Returns the images this rank forwarded.

    Each batch goes through in `pieces` chunks, as training splits it into micro-batches: what fits in memory there
    (after an out-of-memory retry halved it) fits here.

    Every rank must call this with the same number of batches (under FSDP each forward is collective); each
    rank's cumulative average is over equally many batches, so the mean over ranks is the average over all of them.
    """
    layers = norms(model)
    if not layers or batches == 0:
        return 0
    momenta = [layer.momentum for layer in layers]
    was_training = model.training
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # cumulative moving average: every batch counts the same
    model.train()
    seen = 0
    try:
        for x, _ in islice(loader, batches):
            for chunk in x.chunk(pieces):
                with autocast():
                    model(chunk.to(device))
            seen += len(x)
    finally:
        for layer, momentum in zip(layers, momenta, strict=True):
            layer.momentum = momentum
        model.train(was_training)
    if not dist.is_initialized():  # a federated device recalibrates alone: the server averages the devices'
        return seen
    stats = [stat for layer in layers for stat in (layer.running_mean, layer.running_var) if stat is not None]
    collectives.all_reduce_flat(stats)
    for stat in stats:
        stat.div_(dist.get_world_size())
    return seen


@dataclass(frozen=True)
class ModeCheck:
    """Accuracy of the same images in eval mode (running statistics) and in train mode (the batch's)."""

    eval_accuracy: float
    train_mode_accuracy: float
    images: int

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> ModeCheck:
        """From :func:`mode_counts`' three numbers (summed over ranks by the caller)."""
        right_eval, right_batch, total = counts.tolist()
        return cls(right_eval / max(total, 1), right_batch / max(total, 1), int(total))

    @property
    def warning(self) -> str:
        """A one-line warning when eval mode is far below train mode ("" otherwise)."""
        if self.train_mode_accuracy - self.eval_accuracy <= GAP_WARNING:
            return ""
        return (
            f"eval-mode accuracy {self.eval_accuracy:.3f} is far below train-mode accuracy "
            f"{self.train_mode_accuracy:.3f} on the same {self.images} training images: BatchNorm running "
            "statistics do not match the weights (train.bn_recalibration_batches)"
        )


@torch.no_grad()
def mode_counts(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Autocast) -> torch.Tensor | None:
    """Predict `x` in eval mode and again with BatchNorm on batch statistics (dropout stays off): this rank's
    (right in eval mode, right in train mode, images), float64, for the caller to sum over ranks with whatever else
    it reduces (one collective: see pipeline.train.compression.collectives); the running statistics are left as
    they were. None for a model without BatchNorm.

    Every rank must call this (two forwards each, collective under FSDP).
    """
    layers = norms(model)
    if not layers:
        return None
    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in layers]  # type: ignore[union-attr]
    was_training = model.training
    model.eval()
    try:
        with autocast():
            eval_pred = model(x).argmax(dim=1)
        for layer in layers:
            layer.train()
        with autocast():
            batch_pred = model(x).argmax(dim=1)
    finally:
        for layer, (mean, var, count) in zip(layers, saved, strict=True):
            layer.running_mean.copy_(mean)  # type: ignore[union-attr]
            layer.running_var.copy_(var)  # type: ignore[union-attr]
            layer.num_batches_tracked.copy_(count)  # type: ignore[union-attr]
        model.train(was_training)
    return torch.tensor([(eval_pred == y).sum(), (batch_pred == y).sum(), len(y)], dtype=torch.float64, device=x.device)
