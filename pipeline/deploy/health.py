"""Health check of an installed release: run its model on the stored sample and compare with the stored logits.

Local targets' activate.sh runs this file as its HEALTH_COMMAND (`main`), on the release before the switch and
through `<root>/current` after it, i.e. exactly the files a device would load. The TensorRT engine is used when the
release has one and TensorRT with a GPU is available here; otherwise the ONNX model through ONNX Runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.files import first_line
from pipeline.host import python_api_problem
from pipeline.layout import ENGINE_INFO, LABELS, ONNX_NAME, PLAN, SAMPLE_NAME


def check(release: Path, atol: float, atol_fp16: float) -> dict[str, Any]:
    """Run `release/sample.npz` through the release's model: {passed, runtime, reason, shape, argmax, ...}."""
    engine = release / PLAN
    use_engine = engine.is_file() and python_api_problem() is None
    runtime = "tensorrt" if use_engine else "onnxruntime"
    tolerance = atol_fp16 if use_engine and _engine_precision(release) == "fp16" else atol
    base: dict[str, Any] = {"passed": False, "runtime": runtime, "atol": tolerance}
    try:
        with np.load(release / SAMPLE_NAME) as sample:
            x, expected = sample["input"], sample["logits"]
        classes = len((release / LABELS).read_text().splitlines())
        started = time.perf_counter()  # loading the model and one batch through it: what a restart costs
        logits = _run_engine(engine, x) if use_engine else _run_onnx(release / ONNX_NAME, x)
        seconds = round(time.perf_counter() - started, 6)
    # Whatever stops the release from running (corrupt model, missing file, runtime error) is a failed check.
    except Exception as err:
        return {**base, "reason": f"{runtime} could not run the release: {first_line(err)}"}
    return {**base, **compare(logits, expected, classes, tolerance), "seconds": seconds}


def compare(logits: np.ndarray, expected: np.ndarray, classes: int, atol: float) -> dict[str, Any]:
    """The verdict: shape (1, classes), finite, same argmax as `expected`, max |diff| <= atol."""
    facts: dict[str, Any] = {"shape": list(logits.shape)}
    if logits.shape != (1, classes) or expected.shape != (1, classes):
        return {**facts, "reason": f"output shape {logits.shape}, stored {expected.shape}, expected (1, {classes})"}
    if not np.isfinite(logits).all():
        return {**facts, "reason": "output is not finite (NaN or Inf)"}
    diff = float(np.abs(logits.astype(np.float64) - expected.astype(np.float64)).max())
    facts |= {"argmax": int(logits.argmax()), "expected_argmax": int(expected.argmax()), "max_abs_diff": diff}
    if facts["argmax"] != facts["expected_argmax"]:
        return {**facts, "reason": f"argmax {facts['argmax']} != stored argmax {facts['expected_argmax']}"}
    if diff > atol:
        return {**facts, "reason": f"max |diff| {diff:.2e} > atol {atol:.0e}"}
    return {**facts, "passed": True, "reason": ""}


def _engine_precision(release: Path) -> str | None:
    try:
        return json.loads((release / ENGINE_INFO).read_text()).get("precision")
    except (OSError, ValueError):
        return None


def _run_onnx(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["logits"], {"input": x.astype(np.float32)})[0])


def _run_engine(plan: Path, x: np.ndarray) -> np.ndarray:
    """One inference through TensorRT (10.x name-based I/O), with torch holding the device buffers."""
    import tensorrt as trt
    import torch

    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    if engine is None:
        raise RuntimeError("TensorRT cannot deserialize model.plan (built for another TensorRT or GPU?)")
    context = engine.create_execution_context()
    context.set_input_shape("input", tuple(x.shape))
    inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).cuda()
    outputs = torch.empty(tuple(context.get_tensor_shape("logits")), dtype=torch.float32, device="cuda")
    context.set_tensor_address("input", inputs.data_ptr())
    context.set_tensor_address("logits", outputs.data_ptr())
    stream = torch.cuda.current_stream()
    if not context.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("TensorRT execute_async_v3 failed")
    stream.synchronize()
    return outputs.cpu().numpy()


def main(argv: list[str] | None = None) -> int:
    """`health.py --atol A --atol-fp16 B RELEASE_DIR` (the tolerances are `deploy.health_atol*`); 0 when it passes.

    Prints `HEALTH <verdict as JSON>`, which activate.sh hands back to the controller, then for a failed check the
    reason as the last line, which activate.sh reports.
    """
    parser = argparse.ArgumentParser(description="Run a release's model on its stored sample.")
    parser.add_argument("release", type=Path)
    parser.add_argument("--atol", type=float, required=True)
    parser.add_argument("--atol-fp16", type=float, required=True)
    args = parser.parse_args(argv)
    verdict = check(args.release, args.atol, args.atol_fp16)
    print("HEALTH " + json.dumps(verdict))
    if verdict["passed"]:
        return 0
    print(f"health check failed ({verdict['reason']})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
