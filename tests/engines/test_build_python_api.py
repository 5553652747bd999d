"""The TensorRT Python API build against a STAND-IN `tensorrt` module (the real one needs NVIDIA's index and a GPU):
which network and builder flags each major version gets, which ONNX file is parsed, and this host's class built
through it."""

from __future__ import annotations

import enum
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline import engines
from pipeline.config import BuildConfig, Config
from pipeline.engines import detect, python_api
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir
from pipeline.trt.flags import Options
from pipeline.trt.profile import Profile


def standin_tensorrt(version: str, parse_ok: bool = True) -> tuple[types.ModuleType, dict[str, Any]]:
    """A module with the names python_api uses; every call that matters is recorded in the returned dict."""
    seen: dict[str, Any] = {"builder_flags": [], "parsed": None}
    trt = types.ModuleType("tensorrt")
    trt.__version__ = f"{version}.1"
    trt.NetworkDefinitionCreationFlag = enum.IntEnum(
        "NetworkDefinitionCreationFlag", "EXPLICIT_BATCH STRONGLY_TYPED", start=0
    )
    trt.BuilderFlag = enum.Enum("BuilderFlag", "FP16 INT8 GPU_FALLBACK")
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    trt.DeviceType = enum.Enum("DeviceType", "GPU DLA")

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class Config:
        builder_optimization_level = None

        def set_memory_pool_limit(self, pool: Any, size: int) -> None:
            seen["workspace"] = size

        def set_flag(self, flag: Any) -> None:
            seen["builder_flags"].append(flag.name)

        def create_timing_cache(self, data: bytes) -> bytes:
            return data

        def set_timing_cache(self, cache: bytes, ignore_mismatch: bool) -> None:
            pass

        def get_timing_cache(self) -> Any:
            return types.SimpleNamespace(serialize=lambda: b"cache")

        def add_optimization_profile(self, profile: Any) -> None:
            seen["profile"] = profile.shapes

    class Profile_:
        def set_shape(self, name: str, *shapes: Any) -> None:
            self.shapes = (name, *shapes)

    class Builder:
        def __init__(self, logger: Logger) -> None:
            self.config = Config()

        def create_network(self, flags: int) -> str:
            seen["network_flags"] = flags
            return "network"

        def create_builder_config(self) -> Config:
            return self.config

        def create_optimization_profile(self) -> Profile_:
            return Profile_()

        def build_serialized_network(self, network: str, config: Config) -> bytes:
            seen["opt_level"] = config.builder_optimization_level
            return b"plan"

    class OnnxParser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network: str, logger: Logger) -> None:
            pass

        def parse_from_file(self, path: str) -> bool:
            seen["parsed"] = path
            return parse_ok

        def get_error(self, i: int) -> str:
            return "In node 3 (Conv): INVALID_NODE"

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    return trt, seen


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    (tmp_path / "onnx").mkdir()
    for name in ("model.onnx", "model.fp16.onnx", "model.int8.onnx"):
        (tmp_path / "onnx" / name).write_bytes(b"onnx")
    (tmp_path / "staging").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("version", "precision", "network_flags", "builder_flags", "onnx", "opt_level"),
    [
        ("8.5.2", "fp16", 1 << 0, ["FP16"], "model.onnx", None),
        ("8.6.2", "int8", 1 << 0, ["INT8"], "model.int8.onnx", 5),
        ("10.3.0", "fp16", 0, ["FP16"], "model.onnx", 5),
        ("11.0.0", "fp16", 0, [], "model.fp16.onnx", 5),
    ],
)
def test_api_calls_per_version(
    run_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    precision: str,
    network_flags: int,
    builder_flags: list[str],
    onnx: str,
    opt_level: int | None,
):
    trt, seen = standin_tensorrt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    built = python_api.build(
        run_path, run_path / "staging", Profile((1, 16, 16), 8, 32), Options(precision, 64, 5), log=lambda _: None
    )
    assert seen["network_flags"] == network_flags and seen["builder_flags"] == builder_flags
    assert seen["parsed"] == str(run_path / "onnx" / onnx) and seen["workspace"] == 64 << 20
    assert seen["opt_level"] == opt_level and seen["profile"] == (
        "input",
        (1, 1, 16, 16),
        (8, 1, 16, 16),
        (32, 1, 16, 16),
    )
    assert built.tensorrt_version == version and built.onnx == f"onnx/{onnx}" and built.precision == precision
    assert bool(built.notes) == (opt_level is None)
    assert (run_path / "staging/model.plan").read_bytes() == b"plan"


def test_parser_error_is_reported(run_path: Path, monkeypatch: pytest.MonkeyPatch):
    trt, _ = standin_tensorrt("10.3.0", parse_ok=False)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    with pytest.raises(PipelineError, match="TensorRT cannot parse it: In node 3 \\(Conv\\): INVALID_NODE"):
        python_api.build(
            run_path, run_path / "staging", Profile((1, 16, 16), 8, 32), Options("fp16", 64), log=lambda _: None
        )


def test_host_class_built_with_the_python_api(
    make_run: Callable[[Config], RunDir], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """This host's class through the one build path with the Python API builder (stand-in module, no GPU needed)."""
    trt, _ = standin_tensorrt("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(detect, "python_api_problem", lambda: None)
    monkeypatch.setattr(detect, "local_sm", lambda: "sm87")
    absent = str(tmp_path / "no-trtexec")
    cfg = Config(build=BuildConfig(builder="python", trtexec=absent, cache_dir=tmp_path / "engine-cache"))
    run = make_run(cfg)
    result = engines.run(cfg, run, log=lambda _: None)

    klass = "local-sm87-trt10.3.0"
    assert result.status == "done" and result.metrics["class"] == klass and result.metrics["builder"] == "python"
    assert (run.path / result.outputs["engine"]).read_bytes() == b"plan"
    assert (run.path / f"engines/{klass}/timing.cache").read_bytes() == b"cache"
    info = json.loads((run.path / result.outputs["build_info"]).read_text())
    assert info["builder"] == "python" and info["command"] is None and info["tensorrt_version"] == "10.3.0"
    assert info["verification"] == {"checked": False, "reason": f"no trtexec here ({absent!r}) to verify with"}
    assert engines.run(cfg, run, log=lambda _: None).status == "cached"
