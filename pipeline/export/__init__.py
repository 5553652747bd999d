"""Export stage: model/ → onnx/model.onnx, promoted only after it matches PyTorch on real validation images.

The ONNX file is written under a temporary name, checked, run in ONNX Runtime next to the PyTorch model, and only
renamed to `onnx/model.onnx` once the parity gate passes. A failed gate keeps `onnx/parity.json` as the evidence
and leaves any earlier `model.onnx` (and its `sample.npz`) as they were.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline import data
from pipeline.config import Config
from pipeline.consolidate import MODEL_DIR, MODEL_JSON_NAME, WEIGHTS_NAME, load_model
from pipeline.errors import PipelineError
from pipeline.export.onnx_export import export_onnx
from pipeline.export.parity import check_parity, save_sample
from pipeline.manifest import RunDir, StageResult, run_stage, write_json

STAGE = "export"
ONNX = "onnx/model.onnx"
PARITY = "onnx/parity.json"
SAMPLE = "onnx/sample.npz"

__all__ = ["ONNX", "PARITY", "SAMPLE", "STAGE", "run"]


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Export the consolidated model to ONNX with a dynamic batch axis, gated on parity with PyTorch."""
    inputs = [f"{MODEL_DIR}/{WEIGHTS_NAME}", f"{MODEL_DIR}/{MODEL_JSON_NAME}"]
    # The parity images depend on the data (files, not just config) and on the seed that splits them.
    external = {"data": data.fingerprint(cfg.data), "run.seed": str(cfg.run.seed)}
    sections = ("data", "export")
    return run_stage(run, cfg, STAGE, sections, inputs, lambda: _export(cfg, run, log), log, external=external)


def _export(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    model, meta = load_model(run.path / MODEL_DIR)
    images, labels = _validation_images(cfg, meta)
    final = run.path / ONNX
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        facts = export_onnx(model, meta, cfg.export, tmp)
        if facts["opset"] != cfg.export.opset:
            log(f"[{STAGE}] export.opset {cfg.export.opset} raised to {facts['opset']} by the exporter")
        report = check_parity(tmp, model, images, labels, cfg.export.atol, cfg.export.max_batch)
        write_json(run.path / PARITY, report)
        _gate(report, run.path / PARITY)
        save_sample(tmp, images[0], int(labels[0]), run.path / SAMPLE)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    log(
        f"[{STAGE}] {ONNX}: opset {facts['opset']}, batch 1..{cfg.export.max_batch}, parity on {report['samples']} "
        f"images max |diff| {report['max_abs_diff']:.2e}, accuracy {report['onnx_accuracy']:.4f}"
    )
    metrics = {key: report[key] for key in ("max_abs_diff", "top1_agreement", "onnx_accuracy")}
    outputs = {"onnx": ONNX, "parity": PARITY, "sample": SAMPLE}
    return StageResult(STAGE, "done", outputs=outputs, metrics={**metrics, "opset": facts["opset"]})


def _validation_images(cfg: Config, meta: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `export.parity_samples` validation images, shaped and labelled as the model was trained."""
    spec = meta["input"]
    splits = data.load(cfg.data, cfg.run.seed, channels=int(spec["channels"]))
    if splits.info.classes != meta["classes"]:
        raise PipelineError(f"data: its classes differ from those in {MODEL_DIR}/{MODEL_JSON_NAME} (other dataset?)")
    images, labels = data.val_batch(splits, cfg.export.parity_samples)
    size, trained = tuple(images.shape[-2:]), (int(spec["height"]), int(spec["width"]))
    if size != trained:
        got, want = "x".join(map(str, size)), "x".join(map(str, trained))
        raise PipelineError(f"data.image_size: validation images are {got}, the model was trained on {want}")
    return images, labels


def _gate(report: dict[str, Any], path: Path) -> None:
    if not report["passed"]:
        raise PipelineError(
            f"{path}: parity gate failed: max_abs_diff {report['max_abs_diff']:.3g} (atol {report['atol']:g}), "
            f"top1_agreement {report['top1_agreement']:.4f} (needs 1.0) over {report['samples']} images"
        )
