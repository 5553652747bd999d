"""Parity gate: the ONNX file in ONNX Runtime must give the PyTorch model's logits on real validation images."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from onnxruntime import InferenceSession
from torch import nn

from pipeline.errors import PipelineError
from pipeline.files import first_line
from pipeline.onnx_run import ORT_ERRORS, onnx_logits, session


def torch_logits(model: nn.Module, images: torch.Tensor, max_batch: int) -> np.ndarray:
    """Logits of the eval-mode PyTorch `model`, batched like the ONNX run."""
    with torch.inference_mode():
        return torch.cat([model(chunk) for chunk in images.split(max_batch)]).numpy()


def check_parity(
    path: Path, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, atol: float, max_batch: int
) -> dict[str, Any]:
    """Compare the ONNX file with `model` on the same images; the report is what parity.json holds.

    `passed` needs both: every logit within `atol` and the same top-1 class for every image. A NaN anywhere makes
    `max_abs_diff` NaN, which fails the `<=` test as it should.
    """
    got = onnx_logits(path, images.numpy().astype(np.float32), max_batch)
    ref = torch_logits(model, images, max_batch)
    truth = labels.numpy()
    max_abs_diff = float(np.abs(got - ref).max())
    agreement = float((got.argmax(1) == ref.argmax(1)).mean())
    return {
        "samples": len(truth),
        "max_abs_diff": max_abs_diff,
        "top1_agreement": agreement,
        "atol": atol,
        "passed": bool(max_abs_diff <= atol and agreement == 1.0),
        "onnx_accuracy": float((got.argmax(1) == truth).mean()),
        "torch_accuracy": float((ref.argmax(1) == truth).mean()),
    }


def variant_accuracy(
    paths: dict[str, Path], batches: Iterable[tuple[np.ndarray, np.ndarray]]
) -> dict[str, dict[str, float]]:
    """Run every ONNX file in `paths` (which must hold "fp32") over the same labelled batches.

    Returns, per name, `accuracy` and `max_abs_diff` of its logits from the fp32 file's (0 for fp32 itself), plus
    `samples`. One pass over the data serves all files, so a large validation split is read once.

    The graphs run as written: ORT's extended optimizations would replace Q/DQ pairs by its own int8 kernels,
    which on AVX2 CPUs without VNNI saturate their 16-bit intermediate sums and lose accuracy that the Q/DQ graph
    (and TensorRT, accumulating in int32) does not lose.
    """
    sessions = {name: session(path, exact=True) for name, path in paths.items()}
    correct = dict.fromkeys(paths, 0)
    diff = dict.fromkeys(paths, 0.0)
    seen = 0
    for images, labels in batches:
        outputs = {name: _run(session, paths[name], images) for name, session in sessions.items()}
        for name, logits in outputs.items():
            correct[name] += int((logits.argmax(1) == labels).sum())
            # np.maximum keeps a NaN, which then fails every `<=` test downstream.
            diff[name] = float(np.maximum(diff[name], np.abs(logits - outputs["fp32"]).max()))
        seen += len(labels)
    return {
        name: {"accuracy": correct[name] / max(seen, 1), "max_abs_diff": diff[name], "samples": seen} for name in paths
    }


def _run(session: InferenceSession, path: Path, images: np.ndarray) -> np.ndarray:
    try:
        return session.run(None, {session.get_inputs()[0].name: images})[0]
    except ORT_ERRORS as err:
        raise PipelineError(f"{path}: ONNX Runtime cannot run it: {first_line(err)}") from None


def save_sample(path: Path, image: torch.Tensor, label: int, out: Path) -> None:
    """Write `out` (.npz): one real image `input` (1, C, H, W), its `label` and the ONNX file's `logits` for it.

    The deploy stage's health check runs this image on the device and compares with these logits.
    """
    batch = image.reshape(1, *image.shape[-3:]).numpy().astype(np.float32)
    logits = onnx_logits(path, batch, 1)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            np.savez(fh, input=batch, label=np.int64(label), logits=logits)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
