"""Checks on a built engine with trtexec: its plan version, a load, its outputs on the export stage's sample
against ONNX Runtime's, and the latency summary.

trtexec prints `Plan was created with TensorRT version X.Y.Z.B` for `--getPlanVersionOnly` (9.1 and later,
docs/tensorrt.md#plan-version-check), writes `--exportOutput` as a JSON list of {"name", "dimensions", "values"}, and
ends a run with a performance summary: `Throughput: N qps` and `Latency: min = A ms, max = B ms, mean = C ms,
median = D ms, percentile(90%) = E ms, ...`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.trt.flags import PLAN_VERSION_SINCE, version_tuple
from pipeline.trt.profile import Profile

TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2}
"""Largest allowed |engine - ONNX Runtime| per precision; int8 is judged by top-1 agreement instead."""
_PLAN_VERSION = re.compile(r"Plan was created with TensorRT version (\d+(?:\.\d+)*)")
_LATENCY = re.compile(r"(?:^|\]\s)Latency: (.+)$", re.MULTILINE)
_THROUGHPUT = re.compile(r"Throughput: ([0-9.]+) qps")
_STAT = re.compile(r"(min|max|mean|median|percentile\((\d+(?:\.\d+)?)%\)) = ([0-9.]+) ms")


def has_plan_version(version: str | None) -> bool:
    """Whether this TensorRT's trtexec knows `--getPlanVersionOnly`."""
    return version_tuple(version) >= PLAN_VERSION_SINCE


def plan_version_args(plan: str) -> list[str]:
    """trtexec arguments that print the TensorRT version an engine was built with, without loading it."""
    return ["--getPlanVersionOnly", f"--loadEngine={plan}"]


def load_args(plan: str, profile: Profile, dla_core: int | None, io: tuple[str, str] | None) -> list[str]:
    """trtexec arguments that load `plan` and time it at batch 1; with `io` = (raw input file, output JSON file)
    it runs on that input and exports the outputs."""
    args = [f"--loadEngine={plan}", f"--shapes={profile.spec(1)}"]
    if io is not None:
        args += [f"--loadInputs={profile.name}:{io[0]}", f"--exportOutput={io[1]}"]
    return [*args, f"--useDLACore={dla_core}"] if dla_core is not None else args


def parse_plan_version(output: str) -> str | None:
    """The version `--getPlanVersionOnly` printed, None when it printed none."""
    match = _PLAN_VERSION.search(output)
    return match[1] if match else None


def same_version(plan: str, klass: str) -> bool:
    """Whether the plan's version is the class's: "10.3.0" matches a class declared as "10.3" or "10.3.0"."""
    wanted = klass.split(".")
    return plan.split(".")[: len(wanted)] == wanted


def parse_latency(output: str) -> dict[str, float]:
    """trtexec's performance summary as {"throughput_qps", "min_ms", "max_ms", "mean_ms", "median_ms", "p90_ms", ...};
    {} when the run printed none."""
    stats: dict[str, float] = {}
    throughput = _THROUGHPUT.search(output)
    if throughput:
        stats["throughput_qps"] = float(throughput[1])
    latency = _LATENCY.findall(output)
    for name, percent, value in _STAT.findall(latency[-1] if latency else ""):
        key = f"p{percent.removesuffix('.0')}" if percent else name
        stats[f"{key}_ms"] = float(value)
    return stats


def write_input(sample: Path, dest: Path) -> np.ndarray:
    """Write the sample's `input` as the raw little-endian float32 file `--loadInputs` reads; return the stored
    ONNX Runtime logits for it."""
    with np.load(sample) as data:
        x, logits = data["input"], data["logits"]
    dest.write_bytes(np.ascontiguousarray(x, dtype="<f4").tobytes())
    return np.asarray(logits)


def read_output(path: Path, name: str = "logits") -> np.ndarray:
    """The tensor `name` from an `--exportOutput` JSON file, shaped by its "dimensions" ("1x10")."""
    for tensor in json.loads(path.read_text()):
        if tensor.get("name") == name:
            dims = [int(d) for d in str(tensor["dimensions"]).split("x") if d]
            return np.asarray(tensor["values"], dtype=np.float64).reshape(dims)
    raise ValueError(f"{path}: no output named {name!r}")


def agreement(precision: str, logits: np.ndarray, expected: np.ndarray) -> dict[str, Any]:
    """The verdict against ONNX Runtime: within the precision's tolerance (fp32, fp16) or same top-1 (int8)."""
    if logits.shape != expected.shape:
        return {"passed": False, "reason": f"output shape {list(logits.shape)}, ONNX Runtime {list(expected.shape)}"}
    diff = float(np.abs(logits.astype(np.float64) - expected.astype(np.float64)).max())
    top1 = bool((logits.argmax(-1) == expected.argmax(-1)).all())
    facts: dict[str, Any] = {"max_abs_diff": diff, "top1_agrees": top1}
    if precision == "int8":
        ok = top1
        reason = "" if ok else "top-1 class differs from ONNX Runtime"
    else:
        tol = TOLERANCE[precision]
        facts["atol"] = tol
        ok = diff <= tol
        reason = "" if ok else f"max |engine - ONNX Runtime| {diff:.2e} > {tol:.0e} ({precision})"
    return {**facts, "passed": ok, "reason": reason}
