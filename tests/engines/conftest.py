"""A real ONNX export (and its fp16 / int8 variants and sample) for the build stage, run directories holding it,
and stand-in trtexecs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxconverter_common import float16
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from pipeline.config import Config
from pipeline.manifest import RunDir, create_run_dir
from tests.engines.standins import StandinTrtexec


class _Calibration(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self._items = iter([{"input": rng.standard_normal((4, 1, 16, 16)).astype(np.float32)} for _ in range(4)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


@pytest.fixture(scope="session")
def onnx_files(small_onnx: Path) -> dict[str, Path]:
    """The export stage's files for small_cnn: model.onnx, an FP16 graph, a Q/DQ int8 graph and sample.npz
    (one input with ONNX Runtime's logits for it), made with the real converters once per session."""
    out = small_onnx.parent / "onnx-files"
    files = {name: out / name for name in ("model.onnx", "model.fp16.onnx", "model.int8.onnx", "sample.npz")}
    if all(path.exists() for path in files.values()):
        return files
    out.mkdir(exist_ok=True)
    files["model.onnx"].write_bytes(small_onnx.read_bytes())
    fp16 = float16.convert_float_to_float16(onnx.load(str(small_onnx)), keep_io_types=True)
    onnx.save(fp16, str(files["model.fp16.onnx"]))
    quantize_static(
        str(small_onnx),
        str(files["model.int8.onnx"]),
        _Calibration(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )
    x = np.random.default_rng(1).standard_normal((1, 1, 16, 16)).astype(np.float32)
    session = ort.InferenceSession(str(small_onnx), providers=["CPUExecutionProvider"])
    np.savez(files["sample.npz"], input=x, label=np.int64(0), logits=session.run(["logits"], {"input": x})[0])
    return files


@pytest.fixture
def make_run(tmp_path: Path, onnx_files: dict[str, Path]) -> Callable[[Config], RunDir]:
    """make_run(cfg): a run dir with the config snapshot and the export stage's onnx/ files, ready for build."""

    def make(cfg: Config) -> RunDir:
        run = create_run_dir(cfg, tmp_path / "run")
        (run.path / "onnx").mkdir(exist_ok=True)
        for name, path in onnx_files.items():
            (run.path / "onnx" / name).write_bytes(path.read_bytes())
        return run

    return make


@pytest.fixture
def standin(tmp_path: Path) -> Callable[..., StandinTrtexec]:
    """standin(version="10.3.0", mode="ok", name="trtexec"): a stand-in trtexec in its own bin directory."""

    def make(version: str = "10.3.0", mode: str = "ok", name: str = "trtexec") -> StandinTrtexec:
        state = tmp_path / f"standin-{name}"
        state.mkdir(exist_ok=True)
        exe = state / name
        script = Path(__file__).with_name("standin_trtexec.py")
        exe.write_text(f'#!/bin/sh\nSTANDIN_TRTEXEC_STATE={state} exec {sys.executable} {script} "$@"\n')
        exe.chmod(0o755)
        tool = StandinTrtexec(exe, state)
        tool.set(version, mode)
        return tool

    return make


STANDIN = '''#!{python}
"""STAND-IN for NVIDIA's trtexec, written by the build tests (TensorRT cannot exist on this machine).

It checks the arguments the build stage passes, prints trtexec-like output and writes the --saveEngine file.
It builds nothing. Behaviour: {mode!r}; claims TensorRT v{packed}.
"""
import json, os, subprocess, sys, time

args = dict((a[2:].split("=", 1) + [""])[:2] for a in sys.argv[1:] if a.startswith("--"))
print("&&&& RUNNING TensorRT.trtexec [TensorRT v{packed}] # trtexec " + " ".join(sys.argv[1:]), flush=True)
if "version" in args:
    sys.exit(0)
with open({calls!r}, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
print("[I] === Device Information ===")
print("[I] Compute Capability: 8.7")
if {mode!r} == "fail":
    print("[E] Error[4]: [network.cpp::validate::3162] Error Code 4: profile has no dimensions")
    print("ERROR: stand-in build failed on purpose")
    print("[E] Engine set up failed")
    print("&&&& FAILED TensorRT.trtexec [TensorRT v{packed}] # trtexec")
    sys.exit(1)
if {mode!r} == "hang":
    sys.stdout.flush()  # what real trtexec printed before it hung is in its log (it writes through std::endl)
    child = subprocess.Popen(["sleep", "60"])
    with open({calls!r} + ".child", "w") as fh:
        fh.write(str(child.pid))
    time.sleep(60)
required = ["onnx", "saveEngine", "minShapes", "optShapes", "maxShapes", "memPoolSize", "timingCacheFile"]
missing = [key for key in required if not args.get(key)]
if missing or not os.path.isfile(args["onnx"]):
    print("[E] stand-in: missing or bad arguments: " + ", ".join(missing or ["onnx"]))
    sys.exit(2)
with open(args["timingCacheFile"], "a") as fh:
    fh.write("timing entry\\n")
with open(args["saveEngine"], "wb") as fh:
    fh.write(b"STAND-IN ENGINE for " + args["onnx"].encode())
print("&&&& PASSED TensorRT.trtexec [TensorRT v{packed}] # trtexec")
'''


@pytest.fixture
def fake_trtexec(tmp_path: Path) -> Callable[..., Path]:
    """fake_trtexec(mode="ok"|"fail"|"hang", packed="100300"): write the stand-in; its calls go to <path>.calls."""

    def make(mode: str = "ok", packed: str = "100300") -> Path:
        path = tmp_path / "bin" / "fake_trtexec"
        path.parent.mkdir(exist_ok=True)
        calls = str(path) + ".calls"
        path.write_text(STANDIN.format(python=sys.executable, mode=mode, packed=packed, calls=calls))
        path.chmod(0o755)
        return path

    return make
