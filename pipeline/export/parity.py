"""Parity gate: the ONNX file in ONNX Runtime must give the PyTorch model's logits on real validation images."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state
from torch import nn

from pipeline.errors import PipelineError

# ORT's error types live in its binary module and share no base class below Exception.
_ORT_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.InvalidProtobuf,
    ort_state.NoSuchFile,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
)
_QUIET = 3  # ORT log severity "error": its warnings about unused initializers are noise here


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = _QUIET
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except _ORT_ERRORS as err:
        raise PipelineError(f"{path}: ONNX Runtime cannot load it: {_first_line(err)}") from None


def onnx_logits(path: Path, images: np.ndarray, max_batch: int) -> np.ndarray:
    """Logits of the ONNX file at `path` on CPU for `images` (N, C, H, W), in batches of at most `max_batch`."""
    session = _session(path)
    name = session.get_inputs()[0].name
    try:
        chunks = [session.run(None, {name: images[i : i + max_batch]})[0] for i in range(0, len(images), max_batch)]
    except _ORT_ERRORS as err:
        raise PipelineError(f"{path}: ONNX Runtime cannot run it: {_first_line(err)}") from None
    return np.concatenate(chunks)


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
