"""CLI output in an 80-column terminal (and CI logs) and for scripts: whole identifiers, `--wide`, `--json`.

The commands run for real: `pipeline` in a subprocess, or in-process through typer's runner, on run directories
made by the pipeline's own code, releases deployed by the deploy stage, and stand-in Jetsons over SSH.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipeline import deploy
from pipeline.cli import app
from pipeline.config import Config, DeployConfig, LocalTarget, load_config
from pipeline.manifest import RunDir, StageResult, create_run_dir
from pipeline.tables import Col, print_rows
from tests.harness import fixtures

ORIN = "orin-sm87-trt10.3.0"
RUN_IDS = ("20261203-080000-0b7d", "20261202-101500-c4e1", "20261201-093000-5f2a")  # as new_run_id() makes them
STOPPED = (
    "stopped before build: challenger 0.9650 vs champion 0.9712 (20261201-093000-5f2a) with tolerance 0.0050: "
    "not promoted"
)
jetson_fleet = fixtures.jetson_fleet
quiet = {"log": lambda _: None}


def pipeline(*args: str, cwd: Path, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """The `pipeline` command in a terminal `columns` wide."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True, env=env)


def invoke(*args: str, columns: int = 80) -> Any:
    """The CLI in-process (typer's runner), `columns` wide: stdout and stderr apart, the exit code."""
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


def fits(text: str, columns: int = 80) -> bool:
    return all(len(line) <= columns for line in text.splitlines())


def table_rows(stdout: str) -> list[list[str]]:
    """A plain table's lines split on whitespace (every cell of these tables is one word)."""
    return [line.split() for line in stdout.splitlines()]


# --- runs list ----------------------------------------------------------------------------------------------------


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """Three runs as the pipeline records them: a deployed champion, one stopped by the promotion gate (a long
    note), and a newer one whose build was skipped."""
    root = tmp_path / "runs"
    newest, stopped, champion = RUN_IDS
    for run_id, accuracy, stages in (
        (champion, 0.9712, ("train", "consolidate", "export", "build", "deploy")),
        (stopped, 0.9650, ("train", "consolidate", "export")),
        (newest, 0.9720, ("train", "consolidate", "export", "build")),
    ):
        run = create_run_dir(load_config(), root / run_id)
        for stage in stages:
            metrics = {"val_accuracy": accuracy} if stage == "train" else {}
            run.record(StageResult(stage, "skipped" if stage == "build" else "done", metrics=metrics), {})
    RunDir(root / stopped).annotate("stopped", value=STOPPED)
    return root


def test_runs_list_fits_80_columns_with_whole_run_ids(runs_root: Path):
    shown = pipeline("runs", "list", "--root", str(runs_root), cwd=runs_root.parent)
    assert shown.returncode == 0, shown.stderr
    assert fits(shown.stdout), shown.stdout
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["run", "val", "acc", "last", "stage", "note"]
    assert [line.split()[0] for line in lines[1:]] == list(RUN_IDS)  # whole, newest first
    assert lines[1].split()[1:] == ["0.9720", "build", "skipped"]
    assert lines[2].split()[1:4] == ["0.9650", "export", "done"] and "stopped before build" in lines[2]
    assert lines[3].split()[1:] == ["0.9712", "deploy", "done", "deployed", "(champion)"]


def test_runs_list_wide_and_json(runs_root: Path):
    wide = pipeline("runs", "list", "--root", str(runs_root), "--wide", cwd=runs_root.parent)
    assert wide.returncode == 0, wide.stderr
    header, *_ = wide.stdout.splitlines()
    assert header.split()[5:] == ["train", "consolidate", "export", "build", "deploy", "path", "note"]
    assert STOPPED in wide.stdout and str(runs_root / RUN_IDS[0]) in wide.stdout  # nothing shortened

    as_json = pipeline("runs", "list", "--root", str(runs_root), "--json", cwd=runs_root.parent)
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)  # stdout holds the JSON and nothing else
    assert [row["run"] for row in rows] == list(RUN_IDS)
    assert rows[1] == {
        "run": RUN_IDS[1],
        "val_accuracy": 0.965,
        "last_stage": "export done",
        "train": "done",
        "consolidate": "done",
        "export": "done",
        "build": None,
        "deploy": None,
        "path": str(runs_root / RUN_IDS[1]),
        "note": STOPPED,
    }
    assert rows[2]["note"] == "deployed (champion)" and rows[2]["deploy"] == "done"


def test_runs_show_json_is_the_manifest(runs_root: Path):
    shown = pipeline("runs", "show", str(runs_root / RUN_IDS[1]), "--json", cwd=runs_root.parent)
    assert shown.returncode == 0, shown.stderr
    manifest = json.loads(shown.stdout)
    assert manifest["stopped"] == STOPPED and manifest["stages"]["train"]["metrics"] == {"val_accuracy": 0.965}


def test_runs_list_in_a_terminal_too_narrow_for_the_ids_keeps_them_whole(runs_root: Path):
    shown = pipeline("runs", "list", "--root", str(runs_root), cwd=runs_root.parent, columns=40)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[0] for line in shown.stdout.splitlines()[1:]] == list(RUN_IDS)
    assert "deployed (champion)" not in shown.stdout  # the free-text note gave up its room first


# --- deploy status, plan and rollback -----------------------------------------------------------------------------


def deployable_run(path: Path, model: Path) -> RunDir:
    """A run directory holding what the export stage hands to deploy: the ONNX model, a sample input with the
    logits ONNX Runtime gives for it (the health check compares them), and model.json."""
    run = create_run_dir(Config(), path)
    (run.path / "onnx").mkdir()
    (run.path / "model").mkdir()
    shutil.copyfile(model, run.path / "onnx/model.onnx")
    x = np.random.default_rng(0).standard_normal((1, 1, 16, 16)).astype(np.float32)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    np.savez(run.path / "onnx/sample.npz", input=x, label=np.int64(3), logits=session.run(["logits"], {"input": x})[0])
    meta = {
        "architecture": "small_cnn",
        "classes": [f"digit-{i}" for i in range(10)],
        "input": {"channels": 1, "image_size": 16},
    }
    (run.path / "model/model.json").write_text(json.dumps(meta))
    return run


@pytest.fixture
def two_runs(tmp_path: Path, small_onnx: Path) -> list[RunDir]:
    """Two runs with real ONNX exports: two releases (`<run id>-<sha8>`, 29 characters)."""
    return [deployable_run(tmp_path / "runs" / run_id, small_onnx) for run_id in RUN_IDS[1:]]


def test_deploy_status_and_rollback_of_local_targets_at_80_columns(tmp_path: Path, two_runs: list[RunDir]):
    targets = [
        LocalTarget(name="lab-bench-orin", root=tmp_path / "bench"),
        LocalTarget(name="gw-02", root=tmp_path / "gw"),
    ]
    cfg = Config(deploy=DeployConfig(targets=targets))
    first, second = (deploy.run(cfg, run, **quiet).metrics["release"] for run in two_runs)
    config = tmp_path / "targets.toml"
    config.write_text("".join(f'[[deploy.targets]]\nname = "{t.name}"\nroot = "{t.root}"\n' for t in targets))

    shown = invoke("deploy", "status", "--config", str(config))
    assert shown.exit_code == 0, shown.output
    assert fits(shown.stdout), shown.stdout
    # `previous` would make it 86 columns: the optional column is left out, no identifier is cut.
    assert table_rows(shown.stdout) == [
        ["target", "current", "verified"],
        ["lab-bench-orin", second, "yes"],
        ["gw-02", second, "yes"],
    ]
    wide = invoke("deploy", "status", "--config", str(config), "--wide")
    assert table_rows(wide.stdout)[1] == ["lab-bench-orin", second, "yes", first, "2", str(tmp_path / "bench")]
    rows = json.loads(invoke("deploy", "status", "--config", str(config), "--json").stdout)
    assert rows[0] == {
        "target": "lab-bench-orin",
        "root": str(tmp_path / "bench"),
        "current": second,
        "previous": first,
        "releases": 2,
        "verified": "yes",
    }

    back = invoke("deploy", "rollback", "--config", str(config), "--json")
    assert back.exit_code == 0, back.output
    assert json.loads(back.stdout) == [
        {"target": t.name, "status": "ROLLED_BACK", "current": first, "previous": second, "health": "passed"}
        for t in targets
    ]
    shown = invoke("deploy", "status", "--config", str(config))
    assert fits(shown.stdout) and table_rows(shown.stdout)[1] == ["lab-bench-orin", first, "yes"]


def test_deploy_status_over_stand_in_jetsons_at_80_columns(jetson_fleet, two_runs: list[RunDir]):
    fleet = jetson_fleet(3)
    inventory = str(fleet.write_inventory())
    release = deploy.run(Config(deploy=DeployConfig(inventory=Path(inventory))), two_runs[0], **quiet).metrics[
        "release"
    ]
    fleet["orin-03"].kill()

    plan = invoke("deploy", "plan", "--inventory", inventory, "--json")
    assert plan.exit_code == 0 and [row["wave"] for row in json.loads(plan.stdout)] == ["canary", "wave 1", "wave 1"]

    shown = invoke("deploy", "status", "--inventory", inventory)
    assert shown.exit_code == 1  # a device is unreachable
    assert fits(shown.stdout), shown.stdout
    header, one, two, three, *notes = shown.stdout.splitlines()
    assert header.split() == ["target", "status", "class", "current", "temp"]
    assert one.split() == ["orin-01", "reachable", ORIN, release, "45.0", "C"]
    assert two.split() == ["orin-02", "reachable", ORIN, release, "45.0", "C"]
    assert three.split() == ["orin-03", "UNREACHABLE"]
    assert notes[0].startswith("orin-03: ") and "ConnectionRefusedError" in notes[0]  # why, under the table

    wide = invoke("deploy", "status", "--inventory", inventory, "--wide")
    assert wide.exit_code == 1
    assert "NVIDIA Jetson AGX Orin Developer Kit" in wide.stdout and "36.4.3" in wide.stdout
    as_json = invoke("deploy", "status", "--inventory", inventory, "--json")
    assert as_json.exit_code == 1  # scripts see the same exit code
    rows = {row["target"]: row for row in json.loads(as_json.stdout)}
    assert set(rows["orin-01"]) == {
        *("target", "status", "model", "l4t", "jetpack", "tensorrt", "class"),
        *("free", "temp", "current", "previous", "seconds"),
    }
    assert (rows["orin-01"]["class"], rows["orin-01"]["current"], rows["orin-01"]["l4t"]) == (ORIN, release, "36.4.3")
    assert set(rows["orin-03"]) == {"target", "status", "reason"} and rows["orin-03"]["status"] == "UNREACHABLE"


# --- the renderer -------------------------------------------------------------------------------------------------

COLUMNS = (Col("name"), Col("release"), Col("note", text=True), Col("temp", optional=True), Col("why", below=True))
ROW = {"name": "camera-gate-07", "release": "20261201-093000-5f2a-1a2b3c4d", "note": "first canary, then waves"}


def render(rows: list[dict[str, Any]], width: int, **options: Any) -> str:
    out = io.StringIO()
    print_rows(Console(file=out, width=width), rows, COLUMNS, **options)
    return out.getvalue()


def test_free_text_is_shortened_then_optional_columns_left_out_then_the_table_overflows():
    row = {**ROW, "temp": "45.0 C"}
    assert table_rows(render([row], 80)) == [
        ["name", "release", "note", "temp"],
        [ROW["name"], ROW["release"], "first", "canary,", "then", "waves", "45.0", "C"],
    ]
    # 13 columns too many: the note can give 12 (down to MIN_TEXT), so temp goes and the note gets some back.
    narrow = render([row], 66)
    assert fits(narrow, 66) and table_rows(narrow)[1] == [ROW["name"], ROW["release"], "first", "canary,", "then…"]
    # Identifiers alone do not fit: the note is at its floor and the lines are longer than the terminal, ids whole.
    overflowing = render([row], 40)
    assert table_rows(overflowing)[1] == [ROW["name"], ROW["release"], "first", "canar…"]
    assert max(len(line) for line in overflowing.splitlines()) == 14 + 29 + 12 + 2 * 2


def test_below_column_wide_view_and_json(capsys: pytest.CaptureFixture[str]):
    failed = {"name": "camera-dock-02", "note": "[deploy] failed", "why": "ConnectionRefusedError: [bold] failed"}
    text = render([ROW, failed], 80)
    assert table_rows(text)[2] == ["camera-dock-02", "[deploy]", "failed"]  # values, not rich markup
    assert text.splitlines()[-1] == "camera-dock-02: ConnectionRefusedError: [bold] failed"
    wide = render([{**ROW, "extra": "kept"}, failed], 80, wide=True)
    assert table_rows(wide)[0] == ["name", "release", "note", "why", "extra"]  # no row has a temp
    assert "camera-dock-02: " not in wide and "kept" in wide
    print_rows(Console(), [ROW, failed], COLUMNS, as_json=True)
    assert json.loads(capsys.readouterr().out) == [ROW, failed]
