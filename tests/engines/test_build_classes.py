"""Engines per declared device class through a version-aware stand-in trtexec: builds, the engine cache,
verification against ONNX Runtime, failing builds and classes that are not built here."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest

from pipeline import engines
from pipeline.config import BuildClass, BuildConfig, Config, ExportConfig
from pipeline.errors import PipelineError
from pipeline.host import python_api_problem
from pipeline.manifest import RunDir
from pipeline.trt import verify
from tests.engines.standins import StandinTrtexec

MakeRun = Callable[[Config], RunDir]
QUIET = {"log": lambda _: None}
ORIN = "orin-sm87-trt10.3.0"


def config(tmp_path: Path, *classes: dict[str, Any], **build_options: Any) -> Config:
    build_cfg = BuildConfig(classes=list(classes), cache_dir=tmp_path / "engine-cache", **build_options)
    return Config(build=build_cfg, export=ExportConfig(max_batch=32, opt_batch=8))


def klass(tool: StandinTrtexec, name: str = ORIN, tensorrt: str = "10.3", **extra: Any) -> dict[str, Any]:
    return {"name": name, "tensorrt": tensorrt, "builder": "trtexec", "trtexec": str(tool.exe), **extra}


def retrained(path: Path) -> None:
    """Another ONNX file with the same graph (as a retrained model would be): different bytes, same shapes."""
    model = onnx.load(str(path))
    model.doc_string = "retrained"
    onnx.save(model, str(path))


def info(run: RunDir, name: str = ORIN) -> dict[str, Any]:
    return json.loads((run.path / f"engines/{name}/build.json").read_text())


def test_class_build_verifies_against_onnx_runtime(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("10.3.0")
    cfg = config(tmp_path, klass(tool, workspace_mb=256, opt_level=4))
    run = make_run(cfg)
    result = engines.run(cfg, run, **QUIET)

    assert result.status == "done"
    assert result.outputs["engine"] == f"engines/{ORIN}/model.plan" == result.outputs[f"engine:{ORIN}"]
    built = info(run)
    assert built["tensorrt_version"] == "10.3.0" and built["cache"] == "miss" and built["onnx"] == "onnx/model.onnx"
    args = tool.builds()[0]
    assert "--fp16" in args and "--memPoolSize=workspace:256" in args and "--builderOptimizationLevel=4" in args
    checks = built["verification"]
    assert checks["plan_version"] == "10.3.0" and checks["loads"] is True
    assert checks["outputs"]["checked"] and checks["outputs"]["passed"] and checks["outputs"]["max_abs_diff"] < 1e-5
    assert built["latency"] == {
        "throughput_qps": 1523.4,
        "min_ms": 0.61,
        "max_ms": 1.02,
        "mean_ms": 0.64,
        "median_ms": 0.63,
        "p90_ms": 0.67,
        "p95_ms": 0.69,
        "p99_ms": 0.8,
    }
    load = next(a for a in tool.calls() if "--exportOutput" in " ".join(a))
    assert "--shapes=input:1x1x16x16" in load and any(a.startswith("--loadInputs=input:") for a in load)
    assert result.metrics["classes"][ORIN]["status"] == "built" and result.metrics["cache_hits"] == 0
    assert (tmp_path / f"engine-cache/{ORIN}/timing.cache").read_text() == "timing entry\n"
    assert json.loads((run.path / "engines/classes.json").read_text())[0]["cache"] == "miss"


def test_engine_cache_hits_and_misses(make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path):
    tool = standin("10.3.0")
    cfg = config(tmp_path, klass(tool), verify=False)  # verification has its own tests; this one counts builds
    run = make_run(cfg)
    engines.run(cfg, run, **QUIET)
    engine = (run.path / f"engines/{ORIN}/model.plan").read_bytes()
    assert len(tool.builds()) == 1

    (run.path / f"engines/{ORIN}/model.plan").unlink()  # a new run dir: nothing but the cache has the engine
    again = engines.run(cfg, run, **QUIET)
    assert len(tool.builds()) == 1, "a cache hit must not build"
    assert again.metrics["classes"][ORIN]["cache"] == "hit" and again.metrics["cache_hits"] == 1
    assert (run.path / f"engines/{ORIN}/model.plan").read_bytes() == engine
    assert info(run)["cache"] == "hit"
    assert run.manifest()["stages"]["build"]["metrics"]["classes"][ORIN]["status"] == "cached"

    # Each key part on its own makes a miss; the timing cache of the class is reused and extended each time.
    changes: list[Callable[[], None]] = [
        lambda: setattr(cfg.build, "precision", "fp32"),
        lambda: setattr(cfg.build, "opt_level", 2),
        lambda: setattr(cfg.export, "opt_batch", 4),
        lambda: setattr(cfg.build, "workspace_mb", 128),
        lambda: retrained(run.path / "onnx/model.onnx"),
    ]
    for n, change in enumerate(changes, start=2):
        change()
        assert engines.run(cfg, run, **QUIET).metrics["classes"][ORIN]["cache"] == "miss"
        assert len(tool.builds()) == n
    assert (tmp_path / f"engine-cache/{ORIN}/timing.cache").read_text() == "timing entry\n" * len(tool.builds())

    cfg.build.verify = True  # an unverified entry is not good enough once verification is on
    assert engines.run(cfg, run, **QUIET).metrics["classes"][ORIN]["cache"] == "miss"
    assert engines.run(cfg, run, **QUIET).metrics["classes"][ORIN]["cache"] == "hit"

    cfg.build.verify = False
    tool.set(version="10.3.1")  # a TensorRT patch release on the builder: another key
    assert engines.run(cfg, run, **QUIET).metrics["classes"][ORIN]["cache"] == "miss"
    renamed = config(tmp_path, klass(tool, name="orin-nx-sm87-trt10.3.1"), verify=False)
    renamed.build.precision, renamed.build.opt_level, renamed.build.workspace_mb = "fp32", 2, 128
    renamed.export.opt_batch = 4
    assert engines.run(renamed, run, **QUIET).metrics["classes"]["orin-nx-sm87-trt10.3.1"]["cache"] == "miss"


def test_tensorrt_11_builds_the_typed_variant_without_precision_flags(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("11.0.0")
    name = "thor-sm110-trt11.0.0"
    cfg = config(tmp_path, klass(tool, name=name, tensorrt="11.0"), precision="int8")
    run = make_run(cfg)
    assert engines.run(cfg, run, **QUIET).status == "done"
    args = tool.builds()[0]
    assert f"--onnx={run.path / 'onnx/model.int8.onnx'}" in args  # read where export wrote it, not copied
    built = info(run, name)
    assert built["onnx"] == "onnx/model.int8.onnx" and built["precision_flags"] == []
    assert not {"--fp16", "--int8"} & set(args)
    assert built["verification"]["outputs"]["top1_agrees"] is True


def test_int8_before_11_uses_the_qdq_file_with_int8_flag(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("8.6.2")
    name = "orin-sm87-trt8.6.2"
    cfg = config(tmp_path, klass(tool, name=name, tensorrt="8.6.2"), precision="int8")
    run = make_run(cfg)
    engines.run(cfg, run, **QUIET)
    built = info(run, name)
    assert built["onnx"] == "onnx/model.int8.onnx" and "--int8" in tool.builds()[0]
    assert "plan_version" not in built["verification"]  # --getPlanVersionOnly does not exist before 10
    assert not [a for a in tool.calls() if "--getPlanVersionOnly" in a]


def test_plan_version_is_checked_from_9_1(make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path):
    tool = standin("9.1.0")
    name = "orin-sm87-trt9.1.0"
    cfg = config(tmp_path, klass(tool, name=name, tensorrt="9.1"))
    engines.run(cfg, make_run(cfg), **QUIET)
    assert "--skipInference" in tool.builds()[0] and "--buildOnly" not in tool.builds()[0]
    assert [a for a in tool.calls() if "--getPlanVersionOnly" in a]


@pytest.mark.parametrize(
    ("mode", "line"),
    [
        ("parse_error", "ERROR: ModelImporter.cpp:195 In function parseGraph: [6] Invalid Node"),
        ("oom", "Error[1]: [defaultAllocator.cpp::allocate::31] Error Code 1: Cuda Runtime (out of memory)"),
    ],
)
def test_failing_build_surfaces_trtexec_error(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path, mode: str, line: str
):
    tool = standin("10.3.0", mode=mode)
    cfg = config(tmp_path, klass(tool))
    run = make_run(cfg)
    with pytest.raises(PipelineError) as err:
        engines.run(cfg, run, **QUIET)
    assert line in str(err.value) and "\n" not in str(err.value)
    assert f"engines/{ORIN}/build-failed.log" in str(err.value)
    assert not (run.path / f"engines/{ORIN}/model.plan").exists()
    assert not list((tmp_path / "engine-cache").glob(f"{ORIN}/*/model.plan"))


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (
            "perturb",
            r"disagrees with ONNX Runtime on onnx/sample\.npz: max \|engine - ONNX Runtime\| 5\.00e-01 > 1e-02",
        ),
        ("wrong_plan", r"engine plan is TensorRT 9\.9\.9, the class needs 10\.3"),
    ],
)
def test_failed_verification_publishes_and_caches_nothing(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path, mode: str, message: str
):
    tool = standin("10.3.0", mode=mode)
    cfg = config(tmp_path, klass(tool))
    run = make_run(cfg)
    with pytest.raises(PipelineError, match=message):
        engines.run(cfg, run, **QUIET)
    assert not (run.path / f"engines/{ORIN}/model.plan").exists()
    tool.set(mode="ok")
    assert engines.run(cfg, run, **QUIET).metrics["classes"][ORIN]["cache"] == "miss"  # nothing bad was cached


def test_classes_not_built_here_are_reported_with_reasons(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("8.5.2")
    cfg = config(
        tmp_path,
        klass(tool),  # needs 10.3, the trtexec here is 8.5.2
        {"name": "xavier-sm72-trt8.5.2", "tensorrt": "8.5.2", "builder": "device"},
        {"name": "nano", "tensorrt": "8.2", "trtexec": str(tmp_path / "absent")},
    )
    run = make_run(cfg)
    result = engines.run(cfg, run, **QUIET)
    assert result.status == "skipped"
    rows = result.metrics["classes"]
    assert rows[ORIN]["status"] == "not built" and rows[ORIN]["reason"] == (
        "this host (trtexec) has TensorRT 8.5.2, the class needs 10.3"
    )
    assert "the device builds it at install time" in rows["xavier-sm72-trt8.5.2"]["reason"]
    assert "not an executable on PATH" in rows["nano"]["reason"]
    assert f"{ORIN}: not built: this host" in result.reason and result.metrics["not_built"] == 3
    assert run.manifest()["stages"]["build"]["status"] == "skipped"
    assert json.loads((run.path / "engines/classes.json").read_text())[1]["status"] == "not built"
    assert tool.builds() == []


def test_without_sample_outputs_stay_unchecked(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("10.3.0")
    cfg = config(tmp_path, klass(tool))
    run = make_run(cfg)
    (run.path / "onnx/sample.npz").unlink()
    engines.run(cfg, run, **QUIET)
    assert info(run)["verification"]["outputs"] == {
        "checked": False,
        "reason": "onnx/sample.npz is missing (export stage writes it)",
    }


def test_duplicate_class_names_are_refused():
    entry = BuildClass(name="a", tensorrt="10.3")
    with pytest.raises(ValueError, match="duplicate build class name"):
        BuildConfig(classes=[entry, entry])


def test_latency_summary_parsing_ignores_h2d_lines():
    output = "\n".join(
        [
            "[12/02/2026-12:00:00] [I] H2D Latency: min = 9.0 ms, max = 9.0 ms, mean = 9.0 ms, median = 9.0 ms",
            "[12/02/2026-12:00:00] [I] Throughput: 812.4 qps",
            "[12/02/2026-12:00:00] [I] Latency: min = 1.19 ms, max = 1.41 ms, mean = 1.23 ms, median = 1.22 ms, "
            "percentile(90%) = 1.3 ms, percentile(95%) = 1.35 ms, percentile(99%) = 1.4 ms",
            "[12/02/2026-12:00:00] [I] D2H Latency: min = 9.0 ms, max = 9.0 ms, mean = 9.0 ms, median = 9.0 ms",
        ]
    )
    assert verify.parse_latency(output) == {
        "throughput_qps": 812.4,
        "min_ms": 1.19,
        "max_ms": 1.41,
        "mean_ms": 1.23,
        "median_ms": 1.22,
        "p90_ms": 1.3,
        "p95_ms": 1.35,
        "p99_ms": 1.4,
    }
    assert verify.parse_latency("[I] Engine built") == {}
    assert verify.parse_plan_version("[I] Plan was created with TensorRT version 10.3.0") == "10.3.0"
    assert verify.same_version("10.3.0", "10.3") and not verify.same_version("10.4.0", "10.3")


@pytest.mark.gpu
@pytest.mark.skipif(python_api_problem() is not None, reason=f"TensorRT Python API unusable: {python_api_problem()}")
def test_python_api_class_builds_a_real_engine(make_run: MakeRun, tmp_path: Path):
    from pipeline.engines.python_api import tensorrt_version
    from pipeline.host import local_sm

    name = f"local-{local_sm()}-trt{tensorrt_version()}"
    cfg = config(tmp_path, {"name": name, "tensorrt": tensorrt_version(), "builder": "python"}, precision="fp16")
    run = make_run(cfg)
    result = engines.run(cfg, run, **QUIET)
    assert result.metrics["classes"][name]["status"] == "built"
    assert (run.path / f"engines/{name}/model.plan").stat().st_size > 1000
