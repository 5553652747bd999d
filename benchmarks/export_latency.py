"""ONNX Runtime CPU latency of each export variant against PyTorch eager, for the small CNN and resnet18.

Question: how fast does each exported file run on a CPU host compared with the model it came from?
Target: ONNX Runtime fp32 at most 0.7x PyTorch eager latency at batch 1 for resnet18 (224 px).
Every file is made by the export stage's own functions (dynamo export lowered to the TensorRT 8.5 opset, fp16
conversion, Q/DQ int8). Weights are random and int8 is calibrated on random inputs: latency does not depend on them.
ORT runs with its default (full) optimizations, as an application would. Both runtimes get the same thread count
(default 1: steadier on a shared machine) and are timed in interleaved rounds, so machine load hits all alike.
Writes benchmarks/results/export_latency.json.

    python benchmarks/export_latency.py [--iterations 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from models import build_model
from pipeline.config import ExportConfig
from pipeline.export.onnx_export import export_onnx
from pipeline.export.variants import to_fp16, to_int8

RESULTS = Path(__file__).parent / "results" / "export_latency.json"
MODELS = {"small_cnn": (1, 16), "resnet18": (3, 224)}
BATCHES = (1, 8)


def _meta(arch: str, channels: int, size: int) -> dict[str, object]:
    spec = {"channels": channels, "height": size, "width": size}
    return {"architecture": arch, "num_classes": 10, "classes": [str(i) for i in range(10)], "input": spec}


def _interleaved(calls: dict[str, Callable[[], object]], iterations: int) -> dict[str, dict[str, float]]:
    """p50/p99 ms of each call, timed in rounds (one of each per round) so all see the same machine load."""
    for call in calls.values():  # warm-up: allocations, kernel selection
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iterations):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {
        name: {"p50_ms": float(np.percentile(t, 50)), "p99_ms": float(np.percentile(t, 99)), "runs": iterations}
        for name, t in times.items()
    }


def _files(model: torch.nn.Module, arch: str, channels: int, size: int, workdir: Path) -> dict[str, Path]:
    fp32 = workdir / f"{arch}.onnx"
    export_onnx(model, _meta(arch, channels, size), ExportConfig(max_batch=8, opt_batch=8), fp32)
    to_fp16(fp32, workdir / f"{arch}.fp16.onnx")
    rng = np.random.default_rng(0)
    calibration = [rng.standard_normal((8, channels, size, size), dtype=np.float32) for _ in range(4)]
    to_int8(fp32, workdir / f"{arch}.int8.onnx", calibration)
    return {"fp32": fp32, "fp16": workdir / f"{arch}.fp16.onnx", "int8": workdir / f"{arch}.int8.onnx"}


def measure(arch: str, iterations: int, threads: int) -> list[dict[str, object]]:
    """Rows for one architecture: eager and every variant at each batch size, with the ratio to eager."""
    channels, size = MODELS[arch]
    torch.manual_seed(0)
    model = build_model(arch, 10, channels).eval()
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = _files(model, arch, channels, size, Path(tmp))
        sessions = {
            name: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for name, p in files.items()
        }
        for batch in BATCHES:
            x = torch.randn(batch, channels, size, size)
            feed = {"input": x.numpy()}
            calls: dict[str, Callable[[], object]] = {"pytorch eager": lambda x=x: model(x)}
            calls.update({f"onnxruntime {n}": (lambda s=s, f=feed: s.run(None, f)) for n, s in sessions.items()})
            with torch.inference_mode():
                found = _interleaved(calls, iterations)
            eager = found["pytorch eager"]["p50_ms"]
            for runtime, stats in found.items():
                rows.append(
                    {"model": arch, "batch": batch, "runtime": runtime, **stats, "vs_eager": stats["p50_ms"] / eager}
                )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    """The Markdown table of this run (docs/benchmarks.md generates its own from the JSON)."""
    lines = ["| model | batch | runtime | p50 ms | p99 ms | p50 vs eager |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['runtime']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['vs_eager']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    """Measure, write the JSON, print the table and whether the resnet18 target holds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="threads for both PyTorch and ONNX Runtime")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for arch in MODELS for row in measure(arch, args.iterations, args.threads)]
    target = next(
        r for r in rows if r["model"] == "resnet18" and r["batch"] == 1 and r["runtime"] == "onnxruntime fp32"
    )
    result = {
        "question": "ONNX Runtime CPU latency per export variant vs PyTorch eager",
        "target": "resnet18 batch 1: onnxruntime fp32 p50 <= 0.7x eager",
        "target_met": bool(target["vs_eager"] <= 0.7),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": args.threads},
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    print(
        f"\nresnet18 batch 1: onnxruntime fp32 {target['vs_eager']:.2f}x eager (target <= 0.7x): "
        f"{'met' if result['target_met'] else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
