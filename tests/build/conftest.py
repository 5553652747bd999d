"""A real ONNX export for the build stage, and run directories holding it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from models import build_model
from pipeline.config import Config
from pipeline.manifest import RunDir, create_run_dir


def export_small_cnn(path: Path) -> Path:
    """small_cnn (10 classes, 1x16x16) exported as the export stage does it: dynamic batch, input/logits, one file.

    Shared through the session's base temp dir, so build and deploy tests pay for one export (~3 s).
    """
    if path.exists():
        return path
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 1).eval()
    batch = torch.export.Dim("batch", min=1, max=32)
    raw = path.with_name(f"raw-{path.name}")
    torch.onnx.export(
        model,
        (torch.randn(2, 1, 16, 16),),
        str(raw),
        dynamo=True,
        dynamic_shapes=({0: batch},),
        input_names=["input"],
        output_names=["logits"],
    )
    onnx.save(onnx.load(str(raw)), str(path))  # the exporter may put weights in raw.onnx.data: embed them
    return path


@pytest.fixture(scope="session")
def small_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported model (once per session)."""
    return export_small_cnn(tmp_path_factory.getbasetemp() / "small_cnn.onnx")


@pytest.fixture
def make_run(tmp_path: Path, small_onnx: Path) -> Callable[[Config], RunDir]:
    """make_run(cfg): a run dir with the config snapshot and onnx/model.onnx, ready for the build stage."""

    def make(cfg: Config) -> RunDir:
        run = create_run_dir(cfg, tmp_path / "run")
        (run.path / "onnx").mkdir(exist_ok=True)
        (run.path / "onnx/model.onnx").write_bytes(small_onnx.read_bytes())
        return run

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
