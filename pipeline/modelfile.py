"""The `model/` directory: `model.safetensors` plus `model.json`, written by consolidate and read by export.

model.json is what every later stage (and the device) knows about the model: architecture, class names, the input
layout and normalisation, the validation accuracy and where the weights came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from models import MODELS, build_model
from pipeline.errors import PipelineError
from pipeline.files import atomic_path, read_json, write_json
from pipeline.layout import MODEL_JSON_NAME, WEIGHTS_NAME


def write_model(model_dir: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write the weights (one rename, tagged with the architecture and the input normalisation) and then
    model.json into `model_dir`. The tags keep the statistics with the weights when the file is copied alone."""
    tags = {"format": "pt", "architecture": meta["architecture"], "num_classes": str(meta["num_classes"])}
    tags |= {key: json.dumps(meta["input"][key]) for key in ("mean", "std") if key in meta.get("input", {})}
    with atomic_path(model_dir / WEIGHTS_NAME) as tmp:
        save_file({k: t.detach().contiguous() for k, t in state.items()}, str(tmp), metadata=tags)
    write_json(model_dir / MODEL_JSON_NAME, meta)


def load_model(model_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The consolidated model in eval mode, loaded strictly from `model_dir`, and its model.json."""
    meta_path, weights = model_dir / MODEL_JSON_NAME, model_dir / WEIGHTS_NAME
    meta = read_json(meta_path)
    arch, num_classes, channels = _model_spec(meta, meta_path)
    model = build_model(arch, num_classes, channels)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise PipelineError(f"{weights}: cannot read weights: {err}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise PipelineError(f"{weights}: does not fit {arch} in {meta_path.name}: {_first_detail(err)}") from None
    return model.eval(), meta


def recorded_stats(weights: Path) -> tuple[list[float], list[float]] | None:
    """The normalisation (mean, std) a weights file was trained with, when a run of this pipeline wrote it: from
    the safetensors metadata, else from the model.json beside it. None for anything else (torchvision's `.pth`
    files, a safetensors file from elsewhere): those were trained with ImageNet's statistics."""
    if weights.suffix != ".safetensors":
        return None
    try:
        with safe_open(str(weights), framework="pt") as handle:
            tags = handle.metadata() or {}
        if "mean" in tags and "std" in tags:
            return _stats(json.loads(tags["mean"]), json.loads(tags["std"]))
    except (SafetensorError, OSError, ValueError, TypeError):
        return None  # reading the weights proper reports what is wrong with the file, in one line
    beside = weights.parent / MODEL_JSON_NAME
    try:
        spec = read_json(beside)["input"] if beside.is_file() else None
        return _stats(spec["mean"], spec["std"]) if spec is not None else None
    except (PipelineError, KeyError, TypeError, ValueError):
        return None


def _stats(mean: Any, std: Any) -> tuple[list[float], list[float]] | None:
    """Per-channel lists of floats of one length, the stds positive; None for anything else."""
    try:
        pair = [float(v) for v in mean], [float(v) for v in std]
    except (TypeError, ValueError):
        return None
    return pair if pair[0] and len(pair[0]) == len(pair[1]) and min(pair[1]) > 0 else None


def _model_spec(meta: Any, path: Path) -> tuple[str, int, int]:
    """(architecture, num_classes, channels) from model.json, after checking the fields later stages read."""
    try:
        arch, num_classes, spec = meta["architecture"], int(meta["num_classes"]), meta["input"]
        height, width, channels = int(spec["height"]), int(spec["width"]), int(spec["channels"])
        if len(meta["classes"]) != num_classes or min(height, width, channels) < 1:
            raise ValueError("classes/num_classes/input sizes disagree")
    except (KeyError, TypeError, ValueError) as err:
        raise PipelineError(f"{path}: missing or invalid field: {err}") from None
    if arch not in MODELS:
        raise PipelineError(f"{path}: unknown architecture {arch!r} (known: {', '.join(MODELS)})")
    return arch, num_classes, channels


def _first_detail(err: RuntimeError) -> str:
    # load_state_dict puts a generic header on the first line and the useful part on the next.
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0] if lines else type(err).__name__
