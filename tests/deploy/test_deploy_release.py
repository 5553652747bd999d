"""Release files, names, links and pruning, one piece at a time."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import deploy
from pipeline.config import Config, DeployConfig, LocalTarget
from pipeline.deploy import switch
from pipeline.deploy.local import prune
from pipeline.deploy.release import parse_sums, release_id, sums_text, verify_dir
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


def test_release_id_and_sums(tmp_path: Path):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"model")
    expected = "20261202-101500-ab12-" + hashlib.sha256(b"model").hexdigest()[:8]
    assert release_id("20261202-101500-ab12", onnx) == expected
    with pytest.raises(PipelineError, match="release id"):
        release_id("my run", onnx)
    digest = "ab" * 32
    assert sums_text({"b.txt": digest, "a.txt": digest}) == f"{digest}  a.txt\n{digest}  b.txt\n"
    assert parse_sums(f"{digest}  a.txt\n{digest} *b.bin\n", "S") == {"a.txt": digest, "b.bin": digest}
    with pytest.raises(PipelineError, match="not a safe name"):
        parse_sums(f"{digest}  ../../etc/passwd\n", "S")
    with pytest.raises(PipelineError, match="line 1"):
        parse_sums("not a sums line\n", "S")


def test_verify_dir_finds_tampering(tmp_path: Path):
    files = {"model.onnx": b"m", "model.json": b"{}", "labels.txt": b"a\n", "sample.npz": b"s"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (tmp_path / "SHA256SUMS").write_text(sums_text(sha))
    assert verify_dir(tmp_path) is None
    (tmp_path / "labels.txt").write_bytes(b"b\n")
    assert verify_dir(tmp_path) == "labels.txt: sha256 does not match SHA256SUMS"
    (tmp_path / "labels.txt").unlink()
    assert verify_dir(tmp_path) == "labels.txt is missing"
    (tmp_path / "SHA256SUMS").write_text(sums_text({"model.onnx": sha["model.onnx"]}))
    assert verify_dir(tmp_path) == "SHA256SUMS does not list model.json, labels.txt, sample.npz"


def test_links_outside_releases_are_refused(tmp_path: Path):
    (tmp_path / "releases" / "r1").mkdir(parents=True)
    os.symlink("/etc", tmp_path / "current")
    with pytest.raises(PipelineError, match="not releases/<id>"):
        switch.links(tmp_path)
    os.unlink(tmp_path / "current")
    os.symlink("releases/../../x", tmp_path / "current")
    with pytest.raises(PipelineError, match="not a safe name"):
        switch.links(tmp_path)
    os.unlink(tmp_path / "current")
    (tmp_path / "current").mkdir()
    with pytest.raises(PipelineError, match="not a symlink"):
        switch.activate(tmp_path, "r1")
    assert (tmp_path / "current").is_dir()  # refused, not replaced


def test_switch_is_one_rename(tmp_path: Path):
    """A reader polling `current` during 300 switches always finds a link to a complete release."""
    for name in ("r1", "r2"):
        (tmp_path / "releases" / name).mkdir(parents=True)
        (tmp_path / "releases" / name / "model.onnx").write_text(name)
    switch.point(tmp_path, "current", "r1")
    failures: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                (tmp_path / "current" / "model.onnx").read_text()
            except OSError as err:
                failures.append(str(err))

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(300):
        switch.activate(tmp_path, "r2" if i % 2 == 0 else "r1")
    done.set()
    thread.join()
    assert failures == []
    assert switch.links(tmp_path) == switch.Links(current="r1", previous="r2")
    assert not (tmp_path / ".current.new").exists()


def test_prune_never_removes_current_or_previous(tmp_path: Path):
    for age, name in enumerate(["r5", "r4", "r3", "r2", "r1"]):
        (tmp_path / "releases" / name).mkdir(parents=True)
        os.utime(tmp_path / "releases" / name, ns=(10**18 - age * 10**9,) * 2)
    (tmp_path / "releases" / "r9.part").mkdir()  # an interrupted copy is not a release
    switch.point(tmp_path, "current", "r1")
    switch.point(tmp_path, "previous", "r2")
    assert sorted(prune(tmp_path, keep=2)) == ["r3"]
    assert {p.name for p in (tmp_path / "releases").iterdir()} == {"r5", "r4", "r2", "r1", "r9.part"}


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
