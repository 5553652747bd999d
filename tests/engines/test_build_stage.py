"""The build stage: an honest skip without TensorRT, real builds driven through a stand-in trtexec."""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import engines
from pipeline.config import BuildConfig, Config, ExportConfig
from pipeline.engines import detect
from pipeline.errors import PipelineError
from pipeline.host import python_api_problem
from pipeline.manifest import RunDir
from tests.engines.standins import StandinTrtexec

MakeRun = Callable[[Config], RunDir]


def trtexec_config(exe: Path | str, tmp_path: Path, precision: str = "fp16", opt: int = 8) -> Config:
    """This host's class with the build-only stand-in (verification is tested with the version-aware one); the
    engine cache in the test's own directory."""
    build_cfg = BuildConfig(
        builder="auto", trtexec=str(exe), precision=precision, workspace_mb=256, verify=False, cache_dir=tmp_path / "ec"
    )
    return Config(build=build_cfg, export=ExportConfig(max_batch=32, opt_batch=opt))


def calls(exe: Path) -> list[list[str]]:
    path = Path(f"{exe}.calls")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.skipif(python_api_problem() is None, reason="TensorRT and a GPU are present: nothing to skip")
def test_auto_without_tensorrt_skips_and_writes_nothing(make_run: MakeRun, tmp_path: Path):
    run = make_run(trtexec_config(tmp_path / "no-such-trtexec", tmp_path))
    result = engines.run(run.load_config(), run, log=lambda _: None)
    assert result.status == "skipped"
    assert "no TensorRT" in result.reason and "`import tensorrt` failed" in result.reason
    assert "trtexec is not on PATH" in result.reason
    assert not (run.path / "engines").exists()
    assert run.manifest()["stages"]["build"]["status"] == "skipped"


@pytest.mark.skipif(python_api_problem() is None, reason="TensorRT and a GPU are present")
def test_forced_builder_that_is_missing_is_an_error(make_run: MakeRun, tmp_path: Path):
    run = make_run(Config(build=BuildConfig(builder="python")))
    with pytest.raises(PipelineError, match=r"build\.builder: 'python' needs"):
        engines.run(run.load_config(), run, log=lambda _: None)
    cfg = Config(build=BuildConfig(builder="trtexec", trtexec=str(tmp_path / "absent")))
    with pytest.raises(PipelineError, match=r"build\.trtexec: .*absent.* not an executable on PATH"):
        engines.run(cfg, run, log=lambda _: None)


def test_standin_trtexec_build(
    make_run: MakeRun, fake_trtexec: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    exe = fake_trtexec()
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")  # found by name, as on a Jetson
    cfg = trtexec_config("fake_trtexec", tmp_path)
    run = make_run(cfg)
    result = engines.run(cfg, run, log=lambda _: None)

    klass = "local-sm87-trt10.3.0"
    assert result.status == "done"
    assert result.outputs == {"engine": f"engines/{klass}/model.plan", "build_info": f"engines/{klass}/build.json"}
    engine = run.path / result.outputs["engine"]
    assert engine.read_bytes() == f"STAND-IN ENGINE for {run.path / 'onnx/model.onnx'}".encode()
    info = json.loads((run.path / result.outputs["build_info"]).read_text())
    assert info["class"] == klass and info["tensorrt_version"] == "10.3.0" and info["builder"] == "trtexec"
    assert info["precision"] == "fp16" and info["precision_flags"] == ["--fp16"]
    assert info["shapes"] == {"min": [1, 1, 16, 16], "opt": [8, 1, 16, 16], "max": [32, 1, 16, 16]}
    args = shlex.split(info["command"])[1:]
    assert "--minShapes=input:1x1x16x16" in args and "--optShapes=input:8x1x16x16" in args
    assert "--maxShapes=input:32x1x16x16" in args and "--memPoolSize=workspace:256" in args
    assert "--fp16" in args and "--skipInference" in args
    assert any(a.startswith("--timingCacheFile=") and a.endswith("/timing.cache") for a in args)
    assert (run.path / f"engines/{klass}/timing.cache").read_text() == "timing entry\n"
    assert not [p for p in (run.path / "engines").iterdir() if p.name.startswith(".staging")]
    assert result.metrics["engine_bytes"] == engine.stat().st_size and result.metrics["class"] == klass

    # Unchanged inputs, config and TensorRT: cached, trtexec not run again.
    assert engines.run(cfg, run, log=lambda _: None).status == "cached"
    assert len(calls(exe)) == 1

    # A rebuild (new profile) starts from the class's timing cache and extends it.
    cfg.export.opt_batch = 4
    assert engines.run(cfg, run, log=lambda _: None).status == "done"
    assert len(calls(exe)) == 2
    assert (run.path / f"engines/{klass}/timing.cache").read_text() == "timing entry\n" * 2


def test_tensorrt_11_gets_no_fp16_flag_and_records_fp16(
    make_run: MakeRun, fake_trtexec: Callable[..., Path], tmp_path: Path
):
    exe = fake_trtexec(packed="110000")
    cfg = trtexec_config(exe, tmp_path)
    run = make_run(cfg)
    result = engines.run(cfg, run, log=lambda _: None)
    info = json.loads((run.path / result.outputs["build_info"]).read_text())
    assert info["class"] == "local-sm87-trt11.0.0" and info["precision_flags"] == []
    assert info["precision"] == "fp16" and info["onnx"] == "onnx/model.fp16.onnx"  # strongly typed: the graph's types
    assert "--fp16" not in calls(exe)[0]


def test_failed_build_reports_the_error_and_keeps_the_old_engine(
    make_run: MakeRun, fake_trtexec: Callable[..., Path], tmp_path: Path
):
    cfg = trtexec_config(fake_trtexec(), tmp_path)
    run = make_run(cfg)
    engine = run.path / engines.run(cfg, run, log=lambda _: None).outputs["engine"]
    good = engine.read_bytes()

    cfg.build.trtexec = str(fake_trtexec(mode="fail"))
    cfg.build.precision = "fp32"  # a config change, so the stage really runs again
    with pytest.raises(PipelineError) as err:
        engines.run(cfg, run, log=lambda _: None)
    message = str(err.value)
    assert "trtexec on this host exited with status 1: ERROR: stand-in build failed on purpose" in message
    # The class this run built before names this host's GPU before trtexec reports it: the log is kept there.
    failed_log = run.path / "engines/local-sm87-trt10.3.0/build-failed.log"
    assert message.endswith(f"(full log: {failed_log})") and "\n" not in message
    assert engine.read_bytes() == good
    assert "Error Code 4" in failed_log.read_text()
    assert run.manifest()["stages"]["build"]["status"] == "done"  # the failed attempt did not replace the record

    fake_trtexec()  # mended: the next build succeeds and the failure is history
    assert engines.run(cfg, run, log=lambda _: None).status == "done" and not failed_log.exists()


def test_first_failed_build_keeps_its_log_under_local(
    make_run: MakeRun, fake_trtexec: Callable[..., Path], tmp_path: Path
):
    """Before any build has named this host's GPU its class is `local`: a failure's log is kept there, and the build
    that names the class clears it away."""
    cfg = trtexec_config(fake_trtexec(mode="fail"), tmp_path)
    run = make_run(cfg)
    with pytest.raises(PipelineError, match=r"\(full log: .*/engines/local/build-failed\.log\)$"):
        engines.run(cfg, run, log=lambda _: None)
    assert "Error Code 4" in (run.path / "engines/local/build-failed.log").read_text()

    fake_trtexec()
    assert engines.run(cfg, run, log=lambda _: None).metrics["class"] == "local-sm87-trt10.3.0"
    assert sorted(p.name for p in (run.path / "engines").iterdir()) == ["local-sm87-trt10.3.0"]


@pytest.mark.gpu
@pytest.mark.skipif(python_api_problem() is not None, reason=f"TensorRT Python API unusable: {python_api_problem()}")
def test_python_api_builds_a_real_engine(make_run: MakeRun, tmp_path: Path):
    cfg = Config(build=BuildConfig(builder="python", precision="fp16", workspace_mb=256, cache_dir=tmp_path / "ec"))
    run = make_run(cfg)
    result = engines.run(cfg, run, log=lambda _: None)
    info = json.loads((run.path / result.outputs["build_info"]).read_text())
    assert result.status == "done" and info["builder"] == "python" and info["class"].startswith("local-sm")
    assert (run.path / result.outputs["engine"]).stat().st_size > 1000
    assert (run.path / "engines" / info["class"] / "timing.cache").stat().st_size > 0


def test_local_engine_is_verified(make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path):
    tool = standin("10.3.0")
    build_cfg = BuildConfig(builder="trtexec", trtexec=str(tool.exe), precision="fp32", cache_dir=tmp_path / "ec")
    cfg = Config(build=build_cfg)
    run = make_run(cfg)
    info = json.loads((run.path / engines.run(cfg, run, log=lambda _: None).outputs["build_info"]).read_text())
    assert info["verification"]["plan_version"] == "10.3.0" and info["verification"]["outputs"]["passed"]
    assert info["latency"]["p99_ms"] == 0.8

    tool.set(mode="perturb")
    cfg.build.precision = "fp16"
    with pytest.raises(PipelineError, match=r"disagrees with ONNX Runtime .* > 1e-02 \(fp16\)"):
        engines.run(cfg, run, log=lambda _: None)


def test_host_class_is_served_from_the_engine_cache(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(detect, "local_sm", lambda: "sm87")  # torch or nvidia-smi names the GPU before building
    tool = standin("10.3.0")
    cfg = Config(build=BuildConfig(builder="trtexec", trtexec=str(tool.exe), cache_dir=tmp_path / "ec"))
    run = make_run(cfg)
    first = engines.run(cfg, run, log=lambda _: None)
    assert first.metrics["class"] == "local-sm87-trt10.3.0" and first.metrics["cache"] == "miss"
    engine, builds = (run.path / first.outputs["engine"]).read_bytes(), len(tool.builds())

    shutil.rmtree(run.path / "engines")  # as in a new run directory: nothing but the engine cache has the engine
    again = engines.run(cfg, run, log=lambda _: None)
    assert again.status == "done" and again.metrics["cache"] == "hit" and len(tool.builds()) == builds
    assert (run.path / again.outputs["engine"]).read_bytes() == engine


def test_host_and_declared_classes_write_the_same_build_json_fields(
    make_run: MakeRun, standin: Callable[..., StandinTrtexec], tmp_path: Path
):
    tool = standin("10.3.0")
    host_cfg = Config(build=BuildConfig(builder="trtexec", trtexec=str(tool.exe), cache_dir=tmp_path / "ec"))
    run = make_run(host_cfg)
    host = json.loads((run.path / engines.run(host_cfg, run, log=lambda _: None).outputs["build_info"]).read_text())

    declared = {"name": "orin-sm87-trt10.3.0", "tensorrt": "10.3", "builder": "trtexec", "trtexec": str(tool.exe)}
    classes_cfg = Config(build=BuildConfig(classes=[declared], cache_dir=tmp_path / "ec"))
    result = engines.run(classes_cfg, run, log=lambda _: None)
    klass = json.loads((run.path / result.outputs["build_info"]).read_text())

    assert host["class"] == "local" and klass["class"] == "orin-sm87-trt10.3.0"
    assert set(host) == set(klass)
    assert host["verification"]["loads"] and klass["verification"]["loads"]


def test_this_hosts_gpu_comes_from_its_one_earlier_engine_directory(tmp_path: Path):
    """trtexec names the GPU only while building: until then the one `engines/local-<sm>-trt<version>` directory of
    this TensorRT version names it; none, or several, leave the class `local` for the build to name."""
    host = detect.Host(detect.Choice("trtexec", trtexec="trtexec"), tensorrt_version="10.3.0")
    engines = tmp_path / "engines"
    assert host.as_class(engines).name == "local"
    for other in ("orin-sm87-trt10.3.0", "local-sm72-trt8.5.2", "local", "a"):  # another device, TensorRT, or name
        (engines / other).mkdir(parents=True)
    (engines / "classes.json").write_text("[]\n")
    assert host.as_class(engines).name == "local"
    (engines / "local-sm87-trt10.3.0").mkdir()
    assert (host.as_class(engines).name, host.as_class(engines).sm) == ("local-sm87-trt10.3.0", "sm87")
    (engines / "local-sm89-trt10.3.0").mkdir()
    assert host.as_class(engines).name == "local"
