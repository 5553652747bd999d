"""The README's demo, as a user runs it: `pipeline run` on the embedded quickstart config, then again (cached)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = ["pipeline", "run", "--config", "configs/quickstart.toml"]
"""What `make demo` runs (the Makefile's recipe, checked below), and what the test runs."""


def readme_block(heading: str) -> str:
    """The first fenced block after `heading` in README.md."""
    text = (REPO / "README.md").read_text()
    found = re.search(rf"^{re.escape(heading)}\n.*?^```\w*\n(.*?)^```$", text, re.M | re.S)
    assert found, f"README.md: no code block under {heading!r}"
    return found.group(1)


def _pipeline_run(run_dir: Path, device: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", *QUICKSTART, "--run-dir", str(run_dir)]
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
    # What the README shows the demo printing, but for the measured numbers (accuracy, seconds, ids).
    shown = readme_block("### What the demo prints").splitlines()
    for line in [row for row in shown if row.startswith(("train.", "data.", "strategy:", "[consolidate] step-"))]:
        assert line in first.stdout + first.stderr, line  # the ranks print to stderr
    results = json.loads((run_dir / "deploy/results.json").read_text())
    (target,) = results["targets"]
    assert target["status"] == "ACTIVE" and target["health"]["passed"]
    assert os.readlink(device / "current") == f"releases/{target['release']}"

    second = _pipeline_run(run_dir, device)
    for stage in ("train", "consolidate", "export"):
        assert f"[{stage}] cached" in second.stdout
    assert os.readlink(device / "current") == f"releases/{target['release']}"


def test_the_readme_commands_are_the_ones_tested():
    """The README's two set-up commands are `make demo` and `make test` (the project's contract), and `make demo`
    runs exactly the command the test above runs."""
    commands = [line.split("#")[0].strip() for line in readme_block("## Two commands").splitlines()]
    assert commands == ["make demo", "make test"]
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert recipe and recipe.group(1).split() == ["$(BIN)/pipeline", *QUICKSTART[1:]]
