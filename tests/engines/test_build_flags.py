"""The TensorRT version matrix: which ONNX file, which trtexec options and which Python API flags per version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.trt import flags
from pipeline.trt.flags import Options
from pipeline.trt.profile import Profile

PROFILE = Profile((1, 16, 16), opt=8, max=32)


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    (tmp_path / "onnx").mkdir()
    for name in ("model.onnx", "model.fp16.onnx", "model.int8.onnx"):
        (tmp_path / "onnx" / name).write_bytes(b"onnx")
    return tmp_path


def args_for(version: str, precision: str, run_path: Path, **options: int) -> tuple[str, list[str], list[str]]:
    opts = Options(precision, 512, options.get("opt_level"), options.get("dla_core"))
    chosen = flags.plan(version, opts, run_path)
    args, notes = flags.trtexec_args(version, chosen, opts, PROFILE)
    return chosen.onnx, args, notes


@pytest.mark.parametrize(
    ("version", "precision", "onnx", "precision_flags", "workspace", "build_only"),
    [
        ("8.2.1", "fp16", "onnx/model.onnx", ["--fp16"], "--workspace=512", "--buildOnly"),
        ("8.5.2", "fp16", "onnx/model.onnx", ["--fp16"], "--memPoolSize=workspace:512", "--buildOnly"),
        ("8.5.2", "int8", "onnx/model.int8.onnx", ["--int8"], "--memPoolSize=workspace:512", "--buildOnly"),
        ("8.6.2", "fp16", "onnx/model.onnx", ["--fp16"], "--memPoolSize=workspace:512", "--skipInference"),
        ("10.3.0", "fp32", "onnx/model.onnx", [], "--memPoolSize=workspace:512", "--skipInference"),
        ("10.3.0", "fp16", "onnx/model.onnx", ["--fp16"], "--memPoolSize=workspace:512", "--skipInference"),
        ("10.3.0", "int8", "onnx/model.int8.onnx", ["--int8"], "--memPoolSize=workspace:512", "--skipInference"),
        ("11.0.0", "fp16", "onnx/model.fp16.onnx", [], "--memPoolSize=workspace:512", "--skipInference"),
        ("11.0.0", "int8", "onnx/model.int8.onnx", [], "--memPoolSize=workspace:512", "--skipInference"),
        ("11.0.0", "fp32", "onnx/model.onnx", [], "--memPoolSize=workspace:512", "--skipInference"),
    ],
)
def test_command_line_per_version(
    run_path: Path, version: str, precision: str, onnx: str, precision_flags: list[str], workspace: str, build_only: str
):
    chosen, args, _ = args_for(version, precision, run_path)
    assert chosen == onnx
    assert [a for a in args if a in ("--fp16", "--int8", "--bf16")] == precision_flags
    assert workspace in args and build_only in args
    assert [a for a in args if "workspace" in a] == [workspace]
    assert args[:3] == ["--minShapes=input:1x1x16x16", "--optShapes=input:8x1x16x16", "--maxShapes=input:32x1x16x16"]


def test_optimisation_level_only_from_8_6_and_dla_with_gpu_fallback(run_path: Path):
    _, args, notes = args_for("8.5.2", "fp16", run_path, opt_level=5)
    assert not [a for a in args if a.startswith("--builderOptimizationLevel")]
    assert notes == ["builderOptimizationLevel 5 ignored: TensorRT 8.5.2 predates 8.6"]
    for version in ("8.6.2", "10.3.0", "10.7.0", "11.4.1"):
        _, args, notes = args_for(version, "fp16", run_path, opt_level=5, dla_core=1)
        assert "--builderOptimizationLevel=5" in args and not notes
        assert args[-3:-1] == ["--useDLACore=1", "--allowGPUFallback"]


@pytest.mark.parametrize(
    ("version", "jetpack", "problem"),
    [
        ("10.8.0", "", "TensorRT 10.8.0 has no DLA (10.7 was the last release with it; it came back in 11.4.1)"),
        ("11.0.0", "", "TensorRT 11.0.0 has no DLA"),
        ("11.3.0", "", "TensorRT 11.3.0 has no DLA"),
        ("11.4.0", "", "TensorRT 11.4.0 has no DLA"),
        ("11.4.1", "7.2.1", "TensorRT 11.4.1 has DLA only on JetPack 7.2.2 and later (this device runs JetPack 7.2.1)"),
    ],
)
def test_dla_is_refused_where_the_version_has_none(run_path: Path, version: str, jetpack: str, problem: str):
    assert flags.dla_problem(version, jetpack).startswith(problem)
    with pytest.raises(PipelineError, match=rf"^dla_core = 0: {re.escape(problem)}"):
        flags.plan(version, Options("fp16", 512, dla_core=0), run_path, jetpack)
    assert flags.plan(version, Options("fp16", 512), run_path, jetpack).precision == "fp16"  # GPU only: fine
    assert flags.dla_problem("11.4.1", "7.2.2") is None and flags.dla_problem("10.7.0") is None


@pytest.mark.parametrize(("precision", "typed"), [("fp32", False), ("fp16", False), ("fp16", True), ("int8", True)])
def test_the_precision_recorded_is_the_engines(run_path: Path, precision: str, typed: bool):
    """From TensorRT 11 no flag says fp16: the ONNX variant's types do, and the plan records that precision."""
    chosen = flags.plan("11.0.0" if typed else "10.3.0", Options(precision, 512), run_path)
    assert chosen.precision == precision and chosen.strongly_typed is typed


def test_missing_variants_name_export_variants(run_path: Path):
    (run_path / "onnx/model.fp16.onnx").unlink()
    (run_path / "onnx/model.int8.onnx").unlink()
    with pytest.raises(PipelineError, match=r"export\.variants: onnx/model\.fp16\.onnx is missing .* strongly typed"):
        args_for("11.0.0", "fp16", run_path)
    with pytest.raises(PipelineError, match=r"export\.variants: onnx/model\.int8\.onnx is missing .* Q/DQ"):
        args_for("10.3.0", "int8", run_path)
    assert args_for("10.3.0", "fp16", run_path)[0] == "onnx/model.onnx"  # 10.x still builds fp16 from fp32


@pytest.mark.parametrize(
    ("version", "precision", "network", "builder"),
    [
        ("8.5.2", "fp16", ["EXPLICIT_BATCH"], ["FP16"]),
        ("8.6.2", "int8", ["EXPLICIT_BATCH"], ["INT8"]),
        ("10.3.0", "fp16", [], ["FP16"]),
        ("10.3.0", "fp32", [], []),
        ("10.12.0", "fp16", [], ["FP16"]),
        ("11.0.0", "fp16", [], []),
        ("11.0.0", "int8", [], []),
    ],
)
def test_python_api_flags_per_version(version: str, precision: str, network: list[str], builder: list[str]):
    assert flags.python_api_flags(version, Options(precision, 256)) == {"network": network, "builder": builder}
    assert "GPU_FALLBACK" in flags.python_api_flags(version, Options(precision, 256, dla_core=0))["builder"]
