"""Export stage: model/ → onnx/model.onnx (+ model.fp16.onnx, model.int8.onnx), promoted only when every gate passes.

All files are written into a staging directory under onnx/, checked, and run in ONNX Runtime: the fp32 file next to
the PyTorch model on real validation images (parity gate), then every variant on the whole validation split
(accuracy gate: at most `export.max_accuracy_drop` below the fp32 file). Only when all pass are they renamed into
onnx/ together. A failed gate keeps `onnx/parity.json` as the evidence, leaves no file of the failed run behind
and keeps any earlier files as they were.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

# Before onnxruntime.quantization: it appends onnxruntime/transformers to sys.path, whose `models/` namespace
# would otherwise stand for this project's `models` package in an editable install (docs/onnxruntime.md).
import models  # noqa: F401
from pipeline import data
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.export.onnx_export import export_onnx
from pipeline.export.parity import check_parity, save_sample, variant_accuracy
from pipeline.export.variants import VARIANTS, to_fp16, to_int8
from pipeline.files import clear_leftovers, publish, write_json
from pipeline.layout import MODEL_DIR, MODEL_JSON, ONNX, ONNX_DIR, PARITY, SAMPLE, WEIGHTS, onnx_name, onnx_path
from pipeline.manifest import RunDir, Stage, StageResult, run_stage
from pipeline.modelfile import load_model

__all__ = ["STAGE", "run"]


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Export the consolidated model to ONNX (+ requested variants), gated on parity and accuracy."""
    return run_stage(run, cfg, STAGE, lambda: _export(cfg, run, log), log)


def fingerprint(cfg: Config) -> dict[str, str]:
    """The parity images depend on the data (files, not just config) and on the seed that splits them."""
    return {"data": data.fingerprint(cfg.data.for_scoring()), "run.seed": str(cfg.run.seed)}


def _export(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    model, meta = load_model(run.path / MODEL_DIR)
    splits = _splits(cfg, meta)
    images, labels = data.val_batch(splits, cfg.export.parity_samples)
    onnx_dir = run.path / ONNX_DIR
    onnx_dir.mkdir(parents=True, exist_ok=True)
    clear_leftovers(onnx_dir)  # an export killed mid-way left its staging directory
    staging = onnx_dir / f".staging-{os.getpid()}"
    staging.mkdir(parents=True)
    try:
        fp32 = staging / onnx_name("fp32")
        facts = export_onnx(model, meta, cfg.export, fp32)
        log(f"[export] opset {facts['opset']}: {facts['opset_choice']['reason']}")
        report = check_parity(fp32, model, images, labels, cfg.export.atol, cfg.export.max_batch)
        report["opset"] = facts["opset_choice"]
        if "simplified" in facts:
            report["simplified"] = facts["simplified"]
        if not report["passed"]:
            _fail_parity(report, run.path / PARITY)
        files = {"fp32": fp32, **_build_variants(cfg, splits, staging, fp32, log)}
        report.update(_accuracy_report(cfg, splits, files, report))
        write_json(run.path / PARITY, report)
        _accuracy_gate(report, run.path / PARITY)
        save_sample(fp32, images[0], int(labels[0]), staging / Path(SAMPLE).name)
        _promote(staging, onnx_dir, files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _result(cfg, report, facts, files, log)


def _result(
    cfg: Config, report: dict[str, Any], facts: dict[str, Any], files: dict[str, Path], log: Callable[[str], None]
) -> StageResult:
    accuracies = {name: entry["accuracy"] for name, entry in report["variants"].items()}
    log(
        f"[export] {ONNX}: opset {facts['opset']}, batch 1..{cfg.export.max_batch}, parity on {report['samples']} "
        f"images max |diff| {report['max_abs_diff']:.2e}; validation accuracy "
        + ", ".join(f"{name} {value:.4f}" for name, value in accuracies.items())
    )
    metrics = {key: report[key] for key in ("max_abs_diff", "top1_agreement", "onnx_accuracy")}
    metrics.update({f"{name}_accuracy": value for name, value in accuracies.items()})
    outputs = dict(STAGE.outputs)
    outputs.update({f"onnx_{name}": onnx_path(name) for name in files if name != "fp32"})
    return StageResult("export", "done", outputs=outputs, metrics={**metrics, "opset": facts["opset"]})


def _splits(cfg: Config, meta: dict[str, Any]) -> data.Splits:
    """The dataset split as in training, after checking it is the data (classes, image size) the model knows."""
    spec = meta["input"]
    # The model's own normalisation, from model.json: the statistics it was trained with, wherever they came from.
    stats = ([float(v) for v in spec["mean"]], [float(v) for v in spec["std"]])
    splits = data.load(cfg.data.for_scoring(), cfg.run.seed, channels=int(spec["channels"]), stats=stats)
    if splits.info.classes != meta["classes"]:
        raise PipelineError(f"data: its classes differ from those in {MODEL_JSON} (other dataset?)")
    size, trained = (splits.info.image_size,) * 2, (int(spec["height"]), int(spec["width"]))
    if size != trained:
        got, want = "x".join(map(str, size)), "x".join(map(str, trained))
        raise PipelineError(f"data.image_size: validation images are {got}, the model was trained on {want}")
    return splits


def _batches(dataset: torch.utils.data.Dataset, batch: int, limit: int | None = None) -> Iterator[tuple[Any, Any]]:
    """(images float32 NCHW, labels) numpy batches, in order, of at most `limit` items."""
    seen = 0
    for x, y in DataLoader(dataset, batch_size=batch, shuffle=False):
        if limit is not None:
            x, y = x[: limit - seen], y[: limit - seen]
        yield x.numpy().astype(np.float32), y.numpy()
        seen += len(y)
        if limit is not None and seen >= limit:
            return


def _build_variants(
    cfg: Config, splits: data.Splits, staging: Path, fp32: Path, log: Callable[[str], None]
) -> dict[str, Path]:
    files = {}
    for variant in (v for v in VARIANTS if v in cfg.export.variants):
        dest = staging / onnx_name(variant)
        if variant == "fp16":
            to_fp16(fp32, dest)
        else:
            batches = _batches(splits.train_eval, cfg.export.max_batch, cfg.export.calibration_samples)
            calibration = [images for images, _ in batches]
            to_int8(fp32, dest, calibration)
            log(f"[export] int8: calibrated on {sum(len(b) for b in calibration)} training images")
        files[variant] = dest
    return files


def _accuracy_report(
    cfg: Config, splits: data.Splits, files: dict[str, Path], parity: dict[str, Any]
) -> dict[str, Any]:
    """parity.json's accuracy part: every file on the whole validation split, each variant's drop below fp32."""
    measured = variant_accuracy(files, _batches(splits.val, cfg.export.max_batch))
    base = measured["fp32"]["accuracy"]
    limit = cfg.export.max_accuracy_drop
    variants = {}
    for name, found in measured.items():
        drop = base - found["accuracy"]
        fp32 = name == "fp32"
        variants[name] = {
            "file": onnx_path(name),
            "accuracy": found["accuracy"],
            "drop": drop,
            # fp32: logits against PyTorch (the parity gate); variants: against the fp32 file.
            "max_abs_diff": parity["max_abs_diff"] if fp32 else found["max_abs_diff"],
            "passed": bool(parity["passed"]) if fp32 else bool(drop <= limit),
        }
    return {
        "validation_samples": measured["fp32"]["samples"],
        "accuracy_runtime": "onnxruntime CPU, basic graph optimizations (Q/DQ evaluated as written)",
        "max_accuracy_drop": limit,
        "variants": variants,
        "all_passed": all(v["passed"] for v in variants.values()),
    }


def _fail_parity(report: dict[str, Any], path: Path) -> None:
    entry = {"file": ONNX, "accuracy": None, "drop": None, "max_abs_diff": report["max_abs_diff"], "passed": False}
    write_json(path, {**report, "variants": {"fp32": entry}, "all_passed": False})
    raise PipelineError(
        f"{path}: fp32 parity gate failed: max_abs_diff {report['max_abs_diff']:.3g} (atol {report['atol']:g}), "
        f"top1_agreement {report['top1_agreement']:.4f} (needs 1.0) over {report['samples']} images"
    )


def _accuracy_gate(report: dict[str, Any], path: Path) -> None:
    base = report["variants"]["fp32"]["accuracy"]
    failed = [
        f"{name} accuracy {entry['accuracy']:.4f} vs fp32 {base:.4f} (drop {entry['drop']:.4f} > "
        f"export.max_accuracy_drop {report['max_accuracy_drop']:g})"
        for name, entry in report["variants"].items()
        if not entry["passed"]
    ]
    if failed:
        samples = report["validation_samples"]
        raise PipelineError(f"{path}: accuracy gate failed on {samples} validation images: {'; '.join(failed)}")


def _promote(staging: Path, onnx_dir: Path, files: dict[str, Path]) -> None:
    """Move the checked files into onnx/ and drop variant files of earlier runs that this run did not make."""
    for path in staging.iterdir():
        publish(path, onnx_dir / path.name)
    for variant in VARIANTS:
        if variant not in files:
            (onnx_dir / onnx_name(variant)).unlink(missing_ok=True)


STAGE = Stage(
    name="export",
    sections=("data", "export"),
    inputs=(WEIGHTS, MODEL_JSON),
    outputs={"onnx": ONNX, "parity": PARITY, "sample": SAMPLE},
    run=run,
    fingerprint=fingerprint,
)
