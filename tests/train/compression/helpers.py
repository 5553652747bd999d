"""What the compression tests share: a method's config on the digits, and results the ranks write."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import models
from pipeline.config import Config, validate
from pipeline.train.rank import runtime
from pipeline.train.rank.worker import Trainer
from tests.train.ranks import run_ranks


def method_config(method: str, epochs: int, batch_size: int, seed: int = 0, **extra: Any) -> Config:
    """digits/small_cnn on 2 ranks with `method` and `extra` train settings; everything else (`seed` too, which
    draws the weights, the data order and the validation split) the same for every method."""
    train = {"epochs": epochs, "batch_size": batch_size, "compression": method, **extra}
    return validate({"run": {"seed": seed}, "train": train}, "test")


def rank_results(fn: Callable[[Path], None], root: Path) -> list[dict[str, Any]]:
    """Run `fn(root)` on two ranks; what each wrote to root/rank<N>.json."""
    run_ranks(fn, root)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


def small_cnn_params() -> list[torch.Tensor]:
    """The quickstart model's parameters (digits: 10 classes, 1 channel)."""
    return list(models.build_model("small_cnn", 10, 1).parameters())


def mid_epoch_saves(method: str, run_dir: Path, rt: runtime.Runtime, every: int | None = 5) -> list[dict[str, Any]]:
    """One epoch of `method` (12 steps) into `run_dir`, asked to checkpoint every `every` steps: each save's step,
    position in the epoch, and this rank's parameters as they were saved."""
    trainer = Trainer(method_config(method, 1, 128, checkpoint_every_steps=every), run_dir, rt)
    saves, save = [], trainer.save

    def recording(epoch: int, step: int, next_batch: int, synced: bool = False) -> None:
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        saves.append({"step": step, "next_batch": next_batch, "params": params.tolist()})
        save(epoch, step, next_batch, synced)

    trainer.save = recording  # type: ignore[method-assign]
    trainer.fit()
    return saves
