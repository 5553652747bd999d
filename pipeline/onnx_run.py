"""Running an ONNX file in ONNX Runtime on the CPU: for export's gates and for scoring models against each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from pipeline.errors import PipelineError
from pipeline.files import first_line

# ORT's error types live in its binary module and share no base class below Exception.
ORT_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.InvalidProtobuf,
    ort_state.NoSuchFile,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
)
_QUIET = 3  # ORT log severity "error": its warnings about unused initializers are noise here


def session(path: Path, exact: bool = False) -> ort.InferenceSession:
    """A CPU session; `exact` keeps ORT from fusing Q/DQ pairs into its own int8 kernels (int8 accuracy)."""
    options = ort.SessionOptions()
    options.log_severity_level = _QUIET
    if exact:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except ORT_ERRORS as err:
        raise PipelineError(f"{path}: ONNX Runtime cannot load it: {first_line(err)}") from None


def onnx_logits(path: Path, images: np.ndarray, max_batch: int) -> np.ndarray:
    """Logits of the ONNX file at `path` on CPU for `images` (N, C, H, W), in batches of at most `max_batch`."""
    sess = session(path)
    name = sess.get_inputs()[0].name
    try:
        chunks = [sess.run(None, {name: images[i : i + max_batch]})[0] for i in range(0, len(images), max_batch)]
    except ORT_ERRORS as err:
        raise PipelineError(f"{path}: ONNX Runtime cannot run it: {first_line(err)}") from None
    return np.concatenate(chunks)
