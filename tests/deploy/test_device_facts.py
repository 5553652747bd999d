"""A device reporting a TensorRT version no class can carry is refused alone: the rollout goes on for the others and
deploy/results.json names every device's outcome (stand-in Jetsons, the CLI as a user runs it)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline import deploy
from pipeline.cli import main
from pipeline.config import BuildConfig, Config, DeployConfig
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir
from tests.deploy.test_device_build import ORIN107, ORIN_107
from tests.deploy.test_fleet_ssh import ORIN, record_engine, results
from tests.harness import AGX_ORIN_JP62, Board, TargetSpec, fixtures

pytest.importorskip("asyncssh")

jetson_fleet = fixtures.jetson_fleet
HOSTILE = "$(touch${IFS}/tmp/pwned)" + "x" * 480


def reporting(tensorrt: str) -> Board:
    """An Orin whose TensorRT package has version `tensorrt`."""
    return replace(AGX_ORIN_JP62, packages={**AGX_ORIN_JP62.packages, "tensorrt": tensorrt})


def test_a_device_reporting_an_unusable_tensorrt_is_refused_alone(
    jetson_fleet, make_run, onnx_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    fleet = jetson_fleet(
        [
            TargetSpec("orin-01"),
            TargetSpec("orin-rc", board=reporting("10.3.0~rc1-1+cuda12.6")),
            TargetSpec("orin-evil", board=reporting(HOSTILE)),
            TargetSpec("orin-02"),
        ]
    )
    run: RunDir = make_run("run-v", onnx_models[0])
    record_engine(run)
    (run.path / "deploy").mkdir()
    (run.path / "deploy/results.json").write_text(json.dumps({"release": "an earlier deploy's", "targets": []}))
    monkeypatch.chdir(tmp_path)
    inventory = str(fleet.write_inventory(policy={"canary": 0, "max_failure_pct": 100}))

    argv = ["pipeline", "deploy", "run", "--run-dir", str(run.path), "--inventory", inventory]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()

    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("error: deploy: 2 of 4 targets not active: orin-rc (REFUSED: orin-rc: reports TensorRT ")
    rows = results(run)
    assert list(rows) == ["orin-01", "orin-rc", "orin-evil", "orin-02"]
    assert [rows[n]["status"] for n in rows] == ["ACTIVE", "REFUSED", "REFUSED", "ACTIVE"]
    assert rows["orin-01"]["device_class"] == rows["orin-02"]["device_class"] == ORIN
    assert rows["orin-rc"]["reason"] == (
        "orin-rc: reports TensorRT '10.3.0~rc1', not a version this pipeline can use (<major>.<minor>[.<patch>])"
    )
    quoted = repr(HOSTILE[:40] + "...")
    assert rows["orin-evil"]["reason"].startswith(f"orin-evil: reports TensorRT {quoted}, not a version")
    assert all(
        rows[n]["bytes_sent"] == 0 and not (fleet[n].disk / "releases").exists() for n in ("orin-rc", "orin-evil")
    )
    # The hostile text ran nowhere and named no file: not here, not on any device, not in the run.
    assert not Path("/tmp/pwned").exists() and all(not t.path("/tmp/pwned").exists() for t in fleet)
    assert not any("$" in path.name or "~" in path.name for path in run.path.rglob("*"))


def test_a_fault_on_the_controllers_side_for_one_device_fails_that_device_alone(
    jetson_fleet, make_run, onnx_models, tmp_path: Path
):
    """The run's engines/ holds a damaged build.json for the class only orin-107 needs: orin-107 is FAILED with the
    one line naming the file, orin-01 goes ACTIVE, and results.json names both."""
    fleet = jetson_fleet([TargetSpec("orin-01"), TargetSpec("orin-107", board=ORIN_107)])
    run: RunDir = make_run("run-f", onnx_models[0])
    record_engine(run)
    damaged = run.path / f"engines/{ORIN107}"
    damaged.mkdir(parents=True)
    (damaged / "model.plan").write_bytes(b"")
    (damaged / "build.json").write_text("[]")
    cfg = Config(
        build=BuildConfig(cache_dir=tmp_path / "engine-cache", timeout_s=60),
        deploy=DeployConfig(inventory=fleet.write_inventory(policy={"canary": 0, "max_failure_pct": 100})),
    )
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: orin-107 \(FAILED: "):
        deploy.run(cfg, run, log=lambda _: None)
    rows = results(run)
    assert rows["orin-01"]["status"] == "ACTIVE"
    assert rows["orin-107"]["reason"] == f"{damaged}/build.json: not a JSON object (delete the entry)"
