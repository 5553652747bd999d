"""Consolidate stage: the latest sharded DCP checkpoint becomes one `model/model.safetensors` plus `model.json`.

model.json is what every later stage (and the device) knows about the model: architecture, class names, the input
layout and normalisation, the validation accuracy and where the weights came from. Only the "model" entry of the
checkpoint is read; the optimizer state stays behind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from models import build_model
from pipeline import safe_dcp
from pipeline.config import Config
from pipeline.data import DatasetInfo
from pipeline.errors import PipelineError
from pipeline.files import clear_leftovers, read_json, sha256_file
from pipeline.layout import DATASET, LATEST, MODEL_DIR, MODEL_JSON, SUMMARY, WEIGHTS
from pipeline.manifest import RunDir, Stage, StageResult, run_stage, tool_versions
from pipeline.modelfile import write_model


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Turn `train/checkpoints/latest` into `model/model.safetensors` + `model/model.json`."""
    return run_stage(run, cfg, STAGE, lambda: _consolidate(cfg, run, log), log)


def _consolidate(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    step_dir = (run.path / LATEST).resolve()
    info = _dataset_info(run.path / DATASET)
    val_accuracy = _val_accuracy(run.path / SUMMARY)
    model = build_model(cfg.model.name, len(info.classes), info.channels)
    state = model.state_dict()  # shares storage with the module: DCP loads into it in place
    _check_fits(safe_dcp.read_metadata(step_dir), state, step_dir, cfg.model.name)
    safe_dcp.load({"model": state}, step_dir, no_dist=True)
    _check_finite(state, step_dir)
    meta = model_json(cfg, info, step_dir, val_accuracy)
    clear_leftovers(run.path / MODEL_DIR)  # a consolidate killed mid-write left its temp file
    write_model(run.path / MODEL_DIR, state, meta)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"[consolidate] {step_dir.name}: {cfg.model.name}, {parameters:,} parameters -> {WEIGHTS}")
    outputs = dict(STAGE.outputs)
    metrics = {"parameters": parameters, "val_accuracy": val_accuracy, "checkpoint": step_dir.name}
    return StageResult("consolidate", "done", outputs=outputs, metrics=metrics)


def _dataset_info(path: Path) -> DatasetInfo:
    data = read_json(path)
    try:
        return DatasetInfo(
            classes=[str(c) for c in data["classes"]],
            channels=int(data["channels"]),
            image_size=int(data["image_size"]),
            mean=[float(v) for v in data["mean"]],
            std=[float(v) for v in data["std"]],
            normalization=str(data.get("normalization", "dataset")),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise PipelineError(f"{path}: not a dataset description: missing or invalid {err}") from None


def _val_accuracy(path: Path) -> float:
    summary = read_json(path)
    value = summary.get("val_accuracy") if isinstance(summary, dict) else None
    if not isinstance(value, int | float):
        raise PipelineError(f"{path}: no numeric val_accuracy")
    return float(value)


def _some(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")


def _check_fits(metadata: Metadata, state: dict[str, torch.Tensor], step_dir: Path, arch: str) -> None:
    """Compare names and shapes before loading, so a mismatch reads as one line rather than a DCP traceback."""
    saved = {k.removeprefix("model."): v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    problems = []
    if missing := [k for k in state if k not in saved]:
        problems.append(f"missing {_some(missing)}")
    if unexpected := [k for k in saved if k not in state]:
        problems.append(f"unexpected {_some(unexpected)}")
    for key, tensor in state.items():
        item = saved.get(key)
        if item is None:
            continue
        if not isinstance(item, TensorStorageMetadata):
            problems.append(f"{key} is not a tensor")
        elif tuple(item.size) != tuple(tensor.shape):
            problems.append(f"{key} has shape {list(item.size)}, {arch} expects {list(tensor.shape)}")
    if problems:
        raise PipelineError(f"{step_dir}: checkpoint does not fit model.name={arch!r}: {'; '.join(problems[:3])}")


def _check_finite(state: dict[str, torch.Tensor], step_dir: Path) -> None:
    bad = [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise PipelineError(f"{step_dir}: non-finite values (NaN/inf) in {_some(bad)}: training diverged or corrupt")


def checkpoint_sha256(step_dir: Path) -> str:
    """sha256 over a checkpoint directory: each file's relative path and content hash, in sorted order."""
    digest = hashlib.sha256()
    files = sorted((str(p.relative_to(step_dir)), p) for p in step_dir.rglob("*") if p.is_file())
    for rel, path in files:
        digest.update(f"{rel}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def model_json(cfg: Config, info: DatasetInfo, step_dir: Path, val_accuracy: float) -> dict[str, Any]:
    """The model's description: what it is, what it expects as input, how good it is, where it came from."""
    lineage = {
        "checkpoint": step_dir.name,
        "checkpoint_sha256": checkpoint_sha256(step_dir),
        "config_sha256": cfg.digest(),
        "source_commit": tool_versions().get("source_commit"),
    }
    return {
        "architecture": cfg.model.name,
        "num_classes": len(info.classes),
        "classes": info.classes,
        "input": {
            "layout": "NCHW",
            "dtype": "float32",
            "channels": info.channels,
            "height": info.image_size,
            "width": info.image_size,
            "mean": info.mean,
            "std": info.std,
            "normalization": info.normalization,
        },
        "metrics": {"val_accuracy": val_accuracy},
        "lineage": lineage,
    }


STAGE = Stage(
    name="consolidate",
    sections=("model",),
    inputs=(LATEST, DATASET, SUMMARY),
    outputs={"weights": WEIGHTS, "model_json": MODEL_JSON},
    run=run,
)
