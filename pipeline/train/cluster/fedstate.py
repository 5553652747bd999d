"""The controller's record of a federated run: the global model after each round as a checkpoint the consolidate
stage reads (`train/checkpoints/step-<round>`, DCP, `latest` moved only once it is whole and synced), the
normalisation every device uses, and resuming from the last round so recorded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import models
from pipeline import data, layout, safe_dcp
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import fsync_dir, write_json
from pipeline.train.rank import checkpoint, fedwire


class State:
    """The global model, the round it is from, and the statistics the devices normalise with."""

    def __init__(self, cfg: Config, run_dir: Path, classes: int) -> None:
        self.cfg, self.run_dir, self.classes = cfg, run_dir, classes
        self.model: torch.nn.Module | None = None
        self.round = 0
        self.stats: data.Stats | None = None
        self.channels = 0
        self.accuracy: float | None = None
        self.last_saved: int | None = None

    def begin(self, stats: data.Stats, channels: int) -> None:
        """A fresh run: the seeded initial model, for images of `channels` normalised with `stats`."""
        self.stats, self.channels = stats, channels
        torch.manual_seed(self.cfg.run.seed)
        self.model = models.build_model(self.cfg.model.name, self.classes, channels)

    @classmethod
    def resume(cls, cfg: Config, run_dir: Path, classes: int) -> State:
        """The last checkpointed round's model and statistics (refused when written for other data or another model,
        or not by a federated run); without a checkpoint, a state with no model yet (:meth:`begin`)."""
        state = cls(cfg, run_dir, classes)
        found = checkpoint.latest(run_dir / layout.CHECKPOINTS)
        if found is None:
            return state
        meta = checkpoint.read_meta(found)
        if meta.get("resume_key") != checkpoint.resume_key(cfg) or "round" not in meta:
            raise PipelineError(f"{found}: not written by this federated run's data and model; train into a new run")
        state.begin((list(meta["mean"]), list(meta["std"])), int(meta["channels"]))
        assert state.model is not None
        safe_dcp.load({"model": state.model.state_dict()}, found, no_dist=True)
        state.round, state.accuracy, state.last_saved = int(meta["round"]), meta.get("val_accuracy"), int(meta["round"])
        return state

    def arrays(self) -> list[np.ndarray]:
        """The global model as Flower's arrays."""
        assert self.model is not None
        return fedwire.state_arrays(self.model)

    def save(self, number: int, arrays: list[np.ndarray], accuracy: float | None) -> None:
        """Round `number`'s global model as `step-<number>`, then `latest` points to it."""
        assert self.stats is not None and self.model is not None
        fedwire.load_arrays(self.model, arrays)
        root = self.run_dir / layout.CHECKPOINTS
        name = f"step-{number}"
        part = root / f".{name}.part"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        dcp.save({"model": self.model.state_dict()}, checkpoint_id=part, no_dist=True)
        meta = {"round": number, "step": number, "epoch": number, "val_accuracy": accuracy}
        meta |= {
            "mean": self.stats[0],
            "std": self.stats[1],
            "channels": self.channels,
            "resume_key": checkpoint.resume_key(self.cfg),
        }
        write_json(part / checkpoint.TRAINER_JSON, meta)
        fsync_dir(part)
        shutil.rmtree(root / name, ignore_errors=True)
        part.rename(root / name)
        fsync_dir(root)
        checkpoint.point_latest(root, name)
        checkpoint.prune(root, self.cfg.train.keep_checkpoints)
        self.round, self.last_saved = number, number
        if accuracy is not None:
            self.accuracy = accuracy

    def summary(self, classes: list[str]) -> dict[str, Any]:
        """dataset.json written (what consolidate needs of the images); returns summary.json's training fields."""
        if self.last_saved is None or self.stats is None:
            raise PipelineError("train: no federated round produced a model (metrics.jsonl says why, round by round)")
        cfg = self.cfg
        info = data.DatasetInfo(classes, self.channels, cfg.data.image_size, self.stats[0], self.stats[1], "dataset")
        write_json(self.run_dir / layout.DATASET, info.to_dict())
        fed = cfg.train.federated
        return {
            "mode": "federated",
            "rounds": self.round,
            "epochs": self.round,
            "steps": self.round,
            "val_accuracy": self.accuracy,
            "strategy": fed.strategy,
            "delta": fed.delta,
            "samples_per_s": 0.0,
            "eval_mode_accuracy": self.accuracy,
            "train_mode_accuracy": None,
            "bn_recalibration_images": 0,
            "warnings": [],
        }
