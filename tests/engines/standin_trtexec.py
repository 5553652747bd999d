"""STAND-IN for NVIDIA's trtexec with a version-aware command line (TensorRT cannot exist on this machine).

Not NVIDIA's code. It accepts the options the claimed TensorRT version has and rejects the others the way trtexec
does, "builds" an engine that records the ONNX file it came from, and "runs" an engine with ONNX Runtime on that
ONNX file, so outputs compared against ONNX Runtime are real numbers. Its state directory
($STANDIN_TRTEXEC_STATE) holds `knobs.json` ({"version", "mode"}) and `calls.jsonl` (one argv per call).

Modes: ok, parse_error, oom, perturb (outputs off by 0.5), wrong_plan (plan says another version), no_output
(loads but writes no --exportOutput file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

STATE = Path(os.environ["STANDIN_TRTEXEC_STATE"])
MAGIC = b"STAND-IN TRT ENGINE\n"
# The option matrix is the device stand-in's (one table for both), loaded by path: importing the `tests.harness`
# package would start pytest's machinery at every call.
_TOOLS = importlib.util.spec_from_file_location("standin_tools", Path(__file__).parents[1] / "harness/standin_tools.py")
assert _TOOLS is not None and _TOOLS.loader is not None
standin_tools = importlib.util.module_from_spec(_TOOLS)
_TOOLS.loader.exec_module(standin_tools)


def knobs() -> dict[str, str]:
    path = STATE / "knobs.json"
    return {"version": "10.3.0", "mode": "ok", **(json.loads(path.read_text()) if path.exists() else {})}


def packed(version: str) -> str:
    major, minor, patch = (int(p) for p in version.split(".")[:3])
    return str(major * (10000 if major >= 10 else 1000) + minor * 100 + patch)


def log(level: str, text: str) -> None:
    print(f"[12/02/2026-12:00:00] [{level}] {text}", flush=True)


def build(args: dict[str, str], version: str, mode: str) -> int:
    onnx = Path(args["onnx"])
    if not onnx.is_file():
        log("E", f"Could not open file {onnx}")
        return 1
    log("I", f"Start parsing network model. [ONNX: {onnx.stat().st_size} bytes]")
    if mode == "parse_error":
        log("E", '[TRT] ModelImporter.cpp:949: While parsing node number 3 [Conv -> "conv_out"]:')
        log("E", "[TRT] ModelImporter.cpp:955: ERROR: ModelImporter.cpp:195 In function parseGraph: [6] Invalid Node")
        log("E", "Failed to parse onnx file")
        log("E", "Parsing model failed")
        log("E", "Engine set up failed")
        return 1
    if mode == "oom":
        log("E", "Error[1]: [defaultAllocator.cpp::allocate::31] Error Code 1: Cuda Runtime (out of memory)")
        log("E", "Engine could not be created from network")
        log("E", "Building engine failed")
        log("E", "Engine set up failed")
        return 1
    if "timingCacheFile" in args:
        cache = Path(args["timingCacheFile"])
        cache.write_text((cache.read_text() if cache.exists() else "") + "timing entry\n")
    plan_version = "9.9.9" if mode == "wrong_plan" else version
    meta = {"onnx": str(onnx.resolve()), "version": plan_version}
    Path(args["saveEngine"]).write_bytes(MAGIC + json.dumps(meta).encode())
    log("I", "Engine built in 0.42 sec.")
    return 0


def load(args: dict[str, str], version: str, mode: str) -> int:
    data = Path(args["loadEngine"]).read_bytes()
    if not data.startswith(MAGIC):
        log("E", "Failed to verify a plan tag.")
        return 1
    meta = json.loads(data[len(MAGIC) :])
    if "getPlanVersionOnly" in args:
        log("I", f"Plan was created with TensorRT version {meta['version']}")
        return 0
    if "loadInputs" in args and mode != "no_output":
        import numpy as np
        import onnxruntime as ort

        name, _, path = args["loadInputs"].partition(":")
        dims = [int(d) for d in args["shapes"].split(":")[1].split("x")]
        x = np.fromfile(path, dtype="<f4").reshape(dims)
        session = ort.InferenceSession(meta["onnx"], providers=["CPUExecutionProvider"])
        logits = session.run(["logits"], {name: x})[0].astype(np.float64) + (0.5 if mode == "perturb" else 0.0)
        values = ", ".join(repr(float(v)) for v in logits.ravel())
        dims_text = "x".join(str(d) for d in logits.shape)
        Path(args["exportOutput"]).write_text(
            f'[\n  {{ "name" : "logits"\n  , "dimensions" : "{dims_text}"\n  , "values" : [ {values} ]\n  }}\n]\n'
        )
    log("I", "=== Performance summary ===")
    log("I", "Throughput: 1523.4 qps")
    log(
        "I",
        "Latency: min = 0.61 ms, max = 1.02 ms, mean = 0.64 ms, median = 0.63 ms, percentile(90%) = 0.67 ms, "
        "percentile(95%) = 0.69 ms, percentile(99%) = 0.8 ms",
    )
    log("I", "H2D Latency: min = 0.01 ms, max = 0.05 ms, mean = 0.02 ms, median = 0.02 ms")
    return 0


def main(argv: list[str]) -> int:
    state = knobs()
    version, mode = state["version"], state["mode"]
    print(f"&&&& RUNNING TensorRT.trtexec [TensorRT v{packed(version)}] # trtexec {' '.join(argv)}", flush=True)
    args = {key: value for key, _, value in (a[2:].partition("=") for a in argv if a.startswith("--"))}
    if "version" in args:
        return 0
    with (STATE / "calls.jsonl").open("a") as fh:
        fh.write(json.dumps(argv) + "\n")
    refused = standin_tools.refusal(args, version)
    if refused:
        log("E", refused)
        return 1
    rc = load(args, version, mode) if "loadEngine" in args else build(args, version, mode)
    print(f"&&&& {'PASSED' if rc == 0 else 'FAILED'} TensorRT.trtexec [TensorRT v{packed(version)}]", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
