"""The accuracy floor: a model not clearly above chance stops before build and deploy, and the report says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import report
from pipeline.config import validate
from pipeline.files import write_json
from pipeline.layout import DATASET
from pipeline.manifest import RunDir, StageResult, create_run_dir
from pipeline.stages import BelowFloor, accuracy_floor, chance_floor, run_pipeline


def test_the_default_floor_is_clearly_above_chance_for_any_class_count() -> None:
    assert chance_floor(2) == pytest.approx(0.6)
    assert chance_floor(5) == pytest.approx(0.36)
    assert chance_floor(10) == pytest.approx(0.2)
    assert chance_floor(1000) == pytest.approx(0.002)
    assert not accuracy_floor(0.2, 5, None).passed and accuracy_floor(0.36, 5, None).passed
    assert not accuracy_floor(0.9, 5, 0.95).passed  # retrain.min_accuracy wins when set


def fake_pipeline(
    run: RunDir, accuracy: float, classes: int, ran: list[str] | None = None
) -> tuple[list[str], StageResult | None]:
    """Run the pipeline with stages that only record themselves (in `ran`); train reports `accuracy` on `classes`
    classes."""
    ran = [] if ran is None else ran

    def execute(stage: str) -> StageResult:
        ran.append(stage)
        metrics = {"val_accuracy": accuracy} if stage == "train" else {}
        if stage == "train":
            write_json(run.path / DATASET, {"classes": [f"c{i}" for i in range(classes)]})
        result = StageResult(stage, "done", metrics=metrics)
        run.record(result, {})
        return result

    cfg = validate({"run": {"runs_root": str(run.path.parent)}}, "test")
    outcome = run_pipeline(cfg, run, log=lambda _: None, execute=execute)
    return ran, outcome.results.get("deploy") if not outcome.stopped else None


def test_a_model_at_chance_never_reaches_build_or_deploy_and_fails_the_run(tmp_path: Path) -> None:
    run = create_run_dir(validate({}, "test"), tmp_path / "run")
    ran: list[str] = []
    with pytest.raises(BelowFloor, match=r"^stopped before build: validation accuracy 0\.2000 is not clearly") as err:
        ran, _ = fake_pipeline(run, accuracy=0.2, classes=5, ran=ran)
    assert err.value.exit_code == 1  # a failure, not bad input (2) and not a normal stop (0)
    assert ran == ["train", "consolidate", "export"]
    manifest = run.manifest()
    assert manifest["stopped"].startswith("stopped before build: validation accuracy 0.2000 is not clearly above")
    assert manifest["gates"]["floor"]["passed"] is False and manifest["gates"]["floor"]["floor"] == 0.36
    text = report.markdown(run)
    assert "**Stopped early:** stopped before build: validation accuracy 0.2000" in text
    assert "Accuracy floor: failed: validation accuracy 0.2000 is not clearly above chance" in text


def test_a_model_above_the_floor_goes_on_to_build_and_deploy(tmp_path: Path) -> None:
    run = create_run_dir(validate({}, "test"), tmp_path / "run")
    ran, deployed = fake_pipeline(run, accuracy=0.8, classes=5)
    assert ran == ["train", "consolidate", "export", "build", "deploy"] and deployed is not None
    assert "Accuracy floor: passed" in report.markdown(run)


@pytest.mark.slow
def test_pipeline_run_below_the_floor_exits_1_with_one_line_and_writes_the_report(tmp_path: Path) -> None:
    # A real run: one epoch on the digits, held to a floor it cannot reach (retrain.min_accuracy = 1.0).
    settings = ["train.epochs=1", "retrain.min_accuracy=1.0", f"run.runs_root={tmp_path / 'runs'}"]
    sets = [arg for item in settings for arg in ("--set", item)]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "--run-dir", str(run_dir), *sets],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped before build: validation accuracy") and "floor 1.0000" in last
    assert "Traceback" not in proc.stderr
    text = (run_dir / "report.md").read_text()
    assert "**Stopped early:** stopped before build" in text and "Accuracy floor: failed" in text
    assert not (run_dir / "engines").exists() and not (tmp_path / "artifacts").exists()
