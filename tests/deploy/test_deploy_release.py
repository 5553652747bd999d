"""Release files, names and links, one piece at a time."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import deploy
from pipeline.config import Config, DeployConfig, LocalTarget
from pipeline.deploy.release import release_id, sums_text
from pipeline.deploy.stage import local_release
from pipeline.errors import PipelineError
from pipeline.fleet.names import safe_name
from pipeline.manifest import RunDir, StageResult

QUIET = {"log": lambda _: None}
MakeRun = Callable[..., RunDir]
MakeConfig = Callable[..., Config]


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x..y", "a b", "/abs"])
def test_unsafe_names_are_refused(name: str):
    with pytest.raises(PipelineError, match="not a safe name"):
        safe_name(name, "test")


def test_release_id_and_sums():
    digest = "ab" * 32
    sums = sums_text({"b.txt": digest, "a.txt": digest})
    assert sums == f"{digest}  a.txt\n{digest}  b.txt\n"
    sums_digest = hashlib.sha256(sums.encode()).hexdigest()
    assert release_id("20261202-101500-ab12", sums_digest) == f"20261202-101500-ab12-{sums_digest[:8]}"
    with pytest.raises(PipelineError, match="release id"):
        release_id("my run", sums_digest)


def test_the_id_names_every_file_and_the_engine_too(make_run: MakeRun, onnx_models: list[Path]):
    """Same ONNX, another engine (TensorRT builds are not byte-identical): another id. Same files: the same id."""
    run = make_run("run-i", onnx_models[0])
    _record_engine(run, "local-sm87-trt10.3.0")
    first = local_release(run).id
    assert local_release(run).id == first
    (run.path / "engines/local-sm87-trt10.3.0/model.plan").write_bytes(b"rebuilt engine bytes")
    rebuilt = local_release(run).id
    assert rebuilt != first and rebuilt.startswith("run-i-")


def test_stale_files_in_an_interrupted_part_are_not_promoted(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    run = make_run("run-s", onnx_models[0])
    rid = local_release(run).id
    part = tmp_path / "device" / "releases" / f"{rid}.part"
    part.mkdir(parents=True)
    (part / "model.plan").write_bytes(b"an engine this release does not list")
    (part / "model.onnx.tmp").write_bytes(b"half an upload")
    (part / ".hidden").write_text("x")
    deploy.run(deploy_cfg(), run, **QUIET)
    release = tmp_path / "device" / "releases" / rid
    assert sorted(p.name for p in release.iterdir() if p.name != ".order") == sorted(
        ["model.onnx", "model.json", "labels.txt", "sample.npz", "activate.sh", "SHA256SUMS"]
    )
    assert not part.exists()


def test_engine_paths_from_the_manifest_stay_inside_the_run(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    run = make_run("run-o", onnx_models[0])
    (tmp_path / "elsewhere.plan").write_bytes(b"not this run's")
    outputs = {"engine": "../../elsewhere.plan", "build_info": "engines/x/build.json"}
    run.record(StageResult("build", "done", outputs=outputs), {})
    with pytest.raises(PipelineError, match=r"build output '\.\./\.\./elsewhere\.plan' is outside the run directory"):
        deploy.run(deploy_cfg(), run, **QUIET)
    assert not (tmp_path / "device" / "releases").exists()


def test_links_that_are_not_releases_are_refused(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    run = make_run("run-l", onnx_models[0])
    root.mkdir()
    os.symlink("/etc", root / "current")
    with pytest.raises(PipelineError, match=r"local \(FAILED: current points at /etc, not releases/<id>\)"):
        deploy.run(cfg, run, **QUIET)
    assert os.readlink(root / "current") == "/etc"
    os.unlink(root / "current")
    os.symlink("releases/../../x", root / "previous")
    with pytest.raises(PipelineError, match=r"previous points at releases/\.\./\.\./x, not releases/<id>"):
        deploy.run(cfg, run, **QUIET)
    os.unlink(root / "previous")
    (root / "current").mkdir()
    with pytest.raises(PipelineError, match="current exists and is not a symlink; refusing to replace it"):
        deploy.run(cfg, run, **QUIET)
    assert (root / "current").is_dir()  # refused, not replaced


def _record_engine(run: RunDir, klass: str) -> Path:
    engine_dir = run.path / "engines" / klass
    engine_dir.mkdir(parents=True)
    (engine_dir / "model.plan").write_bytes(b"engine bytes")
    (engine_dir / "build.json").write_text(json.dumps({"class": klass, "precision": "fp16"}))
    outputs = {"engine": f"engines/{klass}/model.plan", "build_info": f"engines/{klass}/build.json"}
    run.record(StageResult("build", "done", outputs=outputs), {})
    return engine_dir


def test_engine_from_the_build_stage_travels_with_the_release(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    run = make_run("run-e", onnx_models[0])
    engine_dir = _record_engine(run, "local-sm87-trt10.3.0")
    result = deploy.run(cfg, run, **QUIET)
    release = tmp_path / "device" / "current"
    assert (release / "model.plan").read_bytes() == b"engine bytes"
    assert (release / "engine.json").read_bytes() == (engine_dir / "build.json").read_bytes()
    assert "model.plan" in (release / "SHA256SUMS").read_text()
    (row,) = json.loads((run.path / "deploy/results.json").read_text())["targets"]
    # Without TensorRT here, the health check runs the ONNX of the same release.
    assert row["health"]["runtime"] == "onnxruntime" and row["health"]["passed"]
    assert result.status == "done"


def test_engine_of_another_device_class_stays_behind(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    run = make_run("run-j", onnx_models[0])
    _record_engine(run, "jetson-orin-sm87-trt8.5.2")
    deploy.run(deploy_cfg(), run, **QUIET)
    assert not (tmp_path / "device" / "current" / "model.plan").exists()


def test_relative_target_roots_are_relative_to_the_working_directory(
    tmp_path: Path, make_run: MakeRun, onnx_models: list[Path], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    cfg = Config(deploy=DeployConfig(targets=[LocalTarget(name="rel", root=Path("devices/rel"))]))
    deploy.run(cfg, make_run("run-r", onnx_models[0]), **QUIET)
    assert (tmp_path / "devices/rel/current/model.onnx").is_file()
    (row,) = deploy.status(cfg)
    assert row["root"] == str(tmp_path / "devices/rel") and row["verified"] == "yes"
