"""The README's demo, as a user runs it: `pipeline run` on the embedded quickstart config, then again (cached)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pipeline_run(run_dir: Path, device: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipeline", "run", "--config", "configs/quickstart.toml", "--run-dir", str(run_dir)]
    cmd += ["--set", f'deploy.targets=[{{name="local", root="{device}"}}]', "--set", f"run.runs_root={run_dir.parent}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_quickstart_meets_the_done_criteria_and_reruns_cached(tmp_path: Path):
    run_dir, device = tmp_path / "run", tmp_path / "device"
    first = _pipeline_run(run_dir, device)

    summary = json.loads((run_dir / "train/summary.json").read_text())
    assert summary["val_accuracy"] >= 0.95
    parity = json.loads((run_dir / "onnx/parity.json").read_text())
    assert parity["passed"] and parity["top1_agreement"] == 1.0
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert stages["build"]["status"] == "skipped" and "TensorRT" in stages["build"]["reason"]
    assert "[build] skipped" in first.stdout
    results = json.loads((run_dir / "deploy/results.json").read_text())
    (target,) = results["targets"]
    assert target["status"] == "ACTIVE" and target["health"]["passed"]
    assert os.readlink(device / "current") == f"releases/{target['release']}"

    second = _pipeline_run(run_dir, device)
    for stage in ("train", "consolidate", "export"):
        assert f"[{stage}] cached" in second.stdout
    assert os.readlink(device / "current") == f"releases/{target['release']}"
