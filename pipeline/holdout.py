"""One fixed set of held-out images on which two exported models are scored alike: the promotion gate's evidence.

The images are the challenger's validation split (its data, seed and split fraction); each model sees them with its
own preprocessing from its model.json (size, channels, normalisation), through its exported ONNX file in ONNX
Runtime, so the champion and the challenger are compared on the same pictures by the files that would ship.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline import data
from pipeline.config import DataConfig
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.layout import MODEL_JSON, ONNX
from pipeline.onnx_run import onnx_logits

MAX_IMAGES = 2048
"""Enough to tell two models apart by a point, few enough to score in seconds on a CPU."""


class Holdout:
    """The challenger's validation split, as a scorer of run directories."""

    def __init__(self, cfg: DataConfig, seed: int, challenger: Path) -> None:
        self.cfg, self.seed, self.challenger = cfg, seed, challenger
        self.images = 0
        identity = {"data": data.fingerprint(cfg), "seed": seed, "val_fraction": cfg.val_fraction}
        self.fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        """Names the split: the same data, seed and fraction give the same images."""

    def __call__(self, run: Path) -> float:
        """Accuracy of `run`'s exported model on the held-out images; PipelineError when it cannot be scored."""
        onnx, meta_path = run / ONNX, run / MODEL_JSON
        if not onnx.is_file():
            raise PipelineError(f"{onnx} is missing")
        meta = read_json(meta_path)
        if meta.get("classes") != read_json(self.challenger / MODEL_JSON).get("classes"):
            raise PipelineError(f"{meta_path}: other classes than the challenger's")
        spec = meta["input"]
        sized = self.cfg.model_copy(update={"image_size": int(spec["height"])})
        splits = data.load(sized, self.seed, channels=int(spec["channels"]), stats=(spec["mean"], spec["std"]))
        images, labels = data.val_batch(splits, MAX_IMAGES)
        logits = onnx_logits(onnx, images.numpy().astype(np.float32), 64)
        self.images = len(labels)
        return float((logits.argmax(axis=1) == labels.numpy()).mean())
