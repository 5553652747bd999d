"""The deploy stage against local targets (the same steps and activate.sh as devices): releases, atomic switch,
health check, rollback, pruning."""

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
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir
from tests.deploy.checks import verifies

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
    files = [p for p in release.iterdir() if not p.name.startswith(".")]  # .order: activation order, for pruning
    assert sorted(p.name for p in files) == sorted(
        ["model.onnx", "model.json", "labels.txt", "sample.npz", "activate.sh", "SHA256SUMS"]
    )
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=release, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 5, check.stdout
    assert (release / "model.onnx").read_bytes() == onnx_models[1].read_bytes()
    assert (release / "labels.txt").read_text().splitlines()[9] == "digit-9"

    (first_row,) = json.loads((first.path / "deploy/results.json").read_text())["targets"]
    first_files = [p for p in (root / "releases" / first_id).iterdir() if not p.name.startswith(".")]
    assert first_row["bytes_sent"] == sum(p.stat().st_size for p in first_files) and first_row["files_sent"] == 6
    results = json.loads((second.path / "deploy/results.json").read_text())
    (row,) = results["targets"]
    assert row["status"] == "ACTIVE" and row["release"] == second_id and row["previous"] == first_id
    # What the first release already holds (model.json, labels.txt, activate.sh) is linked, not copied again.
    sent = [p for p in files if p.name in ("model.onnx", "sample.npz", "SHA256SUMS")]
    assert row["bytes_sent"] == sum(p.stat().st_size for p in sent)
    assert (row["files_sent"], row["files_reused"]) == (3, 3)
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
    assert row["status"] == "ACTIVE" and row["bytes_sent"] == 0
    assert {p: p.stat().st_mtime_ns for p in (root / "releases").rglob("*") if p.is_file()} == before

    # A tampered live copy is never rewritten by a deploy (the service may be reading it): refused, left as it is.
    live = root / "releases" / row["release"]
    (live / "model.json").write_text("{}")
    with pytest.raises(PipelineError, match=r"VERIFY_FAILED: releases/run-a-\w+ is live and does not match"):
        deploy.run(cfg, run, **QUIET)
    assert (live / "model.json").read_text() == "{}" and link(root, "current") == f"releases/{row['release']}"

    # Once it is not live any more, the same deploy replaces it with a verified copy.
    other = deploy.run(cfg, make_run("run-b", onnx_models[1]), **QUIET).metrics["release"]
    assert link(root, "previous") == f"releases/{row['release']}"
    deploy.run(cfg, run, **QUIET)
    (row,) = json.loads((run.path / "deploy/results.json").read_text())["targets"]
    assert row["files_reused"] > 0 and verifies(live) and (row["previous"], row["status"]) == (other, "ACTIVE")


def test_failing_health_check_keeps_the_good_release(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    broken = LocalTarget(name="broken", root=tmp_path / "a-file" / "device")
    (tmp_path / "a-file").write_text("not a directory")
    cfg = deploy_cfg(extra=[broken])
    root = tmp_path / "device"
    good = make_run("run-good", onnx_models[0])
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: broken \(FAILED: "):
        deploy.run(cfg, good, **QUIET)
    good_id = json.loads((good.path / "deploy/results.json").read_text())["release"]

    cfg.deploy.targets = cfg.deploy.targets[:1]
    bad = make_run("run-bad", onnx_models[1], wrong_answer=True)
    with pytest.raises(PipelineError) as err:
        deploy.run(cfg, bad, **QUIET)
    # activate.sh's preflight runs the health check before the switch: the bad release never becomes current.
    message = "deploy: 1 of 1 targets not active: local (PREFLIGHT_FAILED: preflight: health check failed (argmax"
    assert message in str(err.value)
    assert link(root, "current") == f"releases/{good_id}" and not (root / "previous").is_symlink()
    assert verifies(root / "releases" / good_id)
    assert release_ids(root) == {good_id}
    (row,) = json.loads((bad.path / "deploy/results.json").read_text())["targets"]
    assert row["status"] == "PREFLIGHT_FAILED" and row["previous"] == good_id and not row["health"]["passed"]
    assert bad.manifest()["stages"].get("deploy") is None


def test_corrupt_onnx_on_a_fresh_target_leaves_nothing_active(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg()
    root = tmp_path / "device"
    run = make_run("run-corrupt", onnx_models[0])
    (run.path / "onnx/model.onnx").write_bytes(b"\x08\x07 definitely not protobuf" * 10)
    with pytest.raises(
        PipelineError, match=r"PREFLIGHT_FAILED: preflight: health check failed \(onnxruntime could not run"
    ):
        deploy.run(cfg, run, **QUIET)
    assert not (root / "current").is_symlink() and not (root / "current").exists()
    assert release_ids(root) == set()


def test_pruning_keeps_the_newest_activations(
    tmp_path: Path, deploy_cfg: MakeConfig, make_run: MakeRun, onnx_models: list[Path]
):
    cfg = deploy_cfg(keep=2)
    root = tmp_path / "device"
    ids = [deploy.run(cfg, make_run(f"run-{i}", onnx_models[0]), **QUIET).metrics["release"] for i in range(3)]
    assert release_ids(root) == set(ids[1:])

    deploy.rollback(cfg, None)  # current = ids[1], previous = ids[2]
    newest = deploy.run(cfg, make_run("run-3", onnx_models[1]), **QUIET).metrics["release"]
    assert link(root, "current") == f"releases/{newest}" and link(root, "previous") == f"releases/{ids[1]}"
    # Newest means most recently activated: the rollback activated ids[1] after ids[2], so ids[2] goes.
    # (That `current` and `previous` survive any `keep` is activate.sh's own test.)
    assert release_ids(root) == {newest, ids[1]}

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
