"""The deploy stage against local targets: releases, atomic switch, health check, rollback, pruning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import deploy
from pipeline.config import Config, LocalTarget
from pipeline.deploy.release import verify_dir
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir

QUIET = {"log": lambda _: None}
MakeRun = Callable[..., RunDir]
MakeConfig = Callable[..., Config]


def link(root: Path, name: str) -> str:
    return os.readlink(root / name)


def release_ids(root: Path) -> set[str]:
    return {p.name for p in (root / "releases").iterdir()}


def test_two_deploys_switch_current_and_previous(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    first, second = make_run("run-a", onnx_models[0]), make_run("run-b", onnx_models[1])

    result = deploy.run(cfg, first, **QUIET)
    assert result.status == "done" and result.metrics["active"] == 1
    first_id = result.metrics["release"]
    assert first_id.startswith("run-a-") and len(first_id) == len("run-a-") + 8
    assert link(root, "current") == f"releases/{first_id}" and not (root / "previous").is_symlink()

    second_id = deploy.run(cfg, second, **QUIET).metrics["release"]
    assert link(root, "current") == f"releases/{second_id}"
    assert link(root, "previous") == f"releases/{first_id}"

    release = root / "releases" / second_id
    assert sorted(p.name for p in release.iterdir()) == sorted(
        ["model.onnx", "model.json", "labels.txt", "sample.npz", "SHA256SUMS"]
    )
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=release, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 4, check.stdout
    assert (release / "model.onnx").read_bytes() == onnx_models[1].read_bytes()
    assert (release / "labels.txt").read_text().splitlines()[9] == "digit-9"

    results = json.loads((second.path / "deploy/results.json").read_text())
    (row,) = results["targets"]
    assert row["status"] == "ACTIVE" and row["release"] == second_id and row["previous"] == first_id
    assert row["bytes_copied"] == sum(p.stat().st_size for p in release.iterdir())
    assert row["health"]["passed"] and row["health"]["runtime"] == "onnxruntime"
    assert row["health"]["max_abs_diff"] <= 1e-3 and row["health"]["shape"] == [1, 10]


def test_redeploying_the_same_release_copies_nothing(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    run = make_run("run-a", onnx_models[0])
    deploy.run(cfg, run, **QUIET)
    before = {p: p.stat().st_mtime_ns for p in (root / "releases").rglob("*") if p.is_file()}

    deploy.run(cfg, run, **QUIET)
    (row,) = json.loads((run.path / "deploy/results.json").read_text())["targets"]
    assert row["status"] == "ACTIVE" and row["bytes_copied"] == 0
    assert {p: p.stat().st_mtime_ns for p in (root / "releases").rglob("*") if p.is_file()} == before

    # A tampered installed copy is not trusted: it is replaced by a verified one.
    (root / "releases" / row["release"] / "model.json").write_text("{}")
    deploy.run(cfg, run, **QUIET)
    (row,) = json.loads((run.path / "deploy/results.json").read_text())["targets"]
    assert row["bytes_copied"] > 0 and verify_dir(root / "releases" / row["release"]) is None


def test_failing_health_check_rolls_back(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    broken = LocalTarget(name="broken", root=tmp_path / "a-file" / "device")
    (tmp_path / "a-file").write_text("not a directory")
    cfg = deploy_cfg(extra=[broken])
    root = tmp_path / "device"
    good = make_run("run-good", onnx_models[0])
    with pytest.raises(PipelineError, match=r"1 of 2 targets failed: broken \(FAILED: "):
        deploy.run(cfg, good, **QUIET)
    good_id = json.loads((good.path / "deploy/results.json").read_text())["release"]

    cfg.deploy.targets = cfg.deploy.targets[:1]
    bad = make_run("run-bad", onnx_models[1], wrong_answer=True)
    with pytest.raises(PipelineError) as err:
        deploy.run(cfg, bad, **QUIET)
    assert "deploy: 1 of 1 targets failed: local (ROLLED_BACK: health check failed (argmax" in str(err.value)
    assert link(root, "current") == f"releases/{good_id}" and not (root / "previous").is_symlink()
    assert verify_dir(root / "releases" / good_id) is None
    assert release_ids(root) == {good_id}
    (row,) = json.loads((bad.path / "deploy/results.json").read_text())["targets"]
    assert row["status"] == "ROLLED_BACK" and row["previous"] == good_id and not row["health"]["passed"]
    assert bad.manifest()["stages"].get("deploy") is None


def test_corrupt_onnx_on_a_fresh_target_leaves_nothing_active(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    run = make_run("run-corrupt", onnx_models[0])
    (run.path / "onnx/model.onnx").write_bytes(b"\x08\x07 definitely not protobuf" * 10)
    with pytest.raises(PipelineError, match=r"ROLLED_BACK: health check failed \(onnxruntime could not run"):
        deploy.run(cfg, run, **QUIET)
    assert not (root / "current").is_symlink() and not (root / "current").exists()
    assert release_ids(root) == set()


def test_pruning_keeps_newest_and_never_current_or_previous(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg(keep=2)
    root = tmp_path / "device"
    ids = [deploy.run(cfg, make_run(f"run-{i}", onnx_models[0]), **QUIET).metrics["release"] for i in range(3)]
    assert release_ids(root) == set(ids[1:])

    deploy.rollback(cfg, None)  # current = ids[1], previous = ids[2]
    newest = deploy.run(cfg, make_run("run-3", onnx_models[1]), **QUIET).metrics["release"]
    assert link(root, "current") == f"releases/{newest}" and link(root, "previous") == f"releases/{ids[1]}"
    # ids[1] is older than ids[2], outside the newest two, but `previous` points at it.
    assert release_ids(root) == {newest, ids[1], ids[2]}

    latest = deploy.run(cfg, make_run("run-4", onnx_models[0]), **QUIET).metrics["release"]
    assert release_ids(root) == {latest, newest}


def test_rollback_swaps_current_and_previous(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    with pytest.raises(PipelineError, match="nothing to roll back to"):
        deploy.rollback(cfg, None)
    a = deploy.run(cfg, make_run("run-a", onnx_models[0]), **QUIET).metrics["release"]
    with pytest.raises(PipelineError, match="nothing to roll back to"):
        deploy.rollback(cfg, "local")
    assert link(root, "current") == f"releases/{a}"
    b = deploy.run(cfg, make_run("run-b", onnx_models[1]), **QUIET).metrics["release"]

    (row,) = deploy.rollback(cfg, "local")
    assert row == {"target": "local", "status": "ROLLED_BACK", "current": a, "previous": b, "health": "passed"}
    assert link(root, "current") == f"releases/{a}" and link(root, "previous") == f"releases/{b}"
    deploy.rollback(cfg, None)
    assert link(root, "current") == f"releases/{b}"
    with pytest.raises(PipelineError, match="no target named 'nope'"):
        deploy.rollback(cfg, "nope")

    (status,) = deploy.status(cfg)
    assert status["current"] == b and status["previous"] == a and status["verified"] == "yes"
    assert status["releases"] == 2

    shutil.rmtree(root / "releases" / a)
    with pytest.raises(PipelineError, match=r"previous release .* fails verification"):
        deploy.rollback(cfg, None)
    assert link(root, "current") == f"releases/{b}"
