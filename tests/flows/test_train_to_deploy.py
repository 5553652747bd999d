"""The whole train-to-deploy flow under a real Prefect API: every stage as a task, on one run directory."""

import json
import os
from pathlib import Path

import pytest

from flows.train_to_deploy import train_to_deploy


def _overrides(tmp_path: Path, epochs: int = 3) -> list[str]:
    return [f"train.epochs={epochs}", f'deploy.targets=[{{name="edge", root="{tmp_path / "device"}"}}]']


def test_flow_runs_every_stage_and_deploys(tmp_path: Path):
    run_dir = tmp_path / "run"
    results = train_to_deploy(run_dir=str(run_dir), overrides=_overrides(tmp_path))

    assert [results[s]["status"] for s in ("train", "consolidate", "export", "deploy")] == ["done"] * 4
    assert results["train"]["metrics"]["val_accuracy"] >= 0.8
    assert results["build"]["status"] == "skipped" and "TensorRT" in results["build"]["reason"]
    parity = json.loads((run_dir / "onnx/parity.json").read_text())
    assert parity["passed"] and parity["top1_agreement"] == 1.0
    current = tmp_path / "device/current"
    assert current.is_symlink() and os.readlink(current).startswith("releases/")
    assert (current / "model.onnx").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"train", "consolidate", "export", "build", "deploy"}
    assert "| train | done |" in (run_dir / "report.md").read_text()


def test_flow_fails_when_a_stage_fails(tmp_path: Path):
    state = train_to_deploy(
        run_dir=str(tmp_path / "run"),
        overrides=["data.source=imagefolder", f"data.path={tmp_path / 'none'}"],
        return_state=True,
    )
    assert state.is_failed()
    with pytest.raises(Exception, match=r"data\.path"):
        state.result()
