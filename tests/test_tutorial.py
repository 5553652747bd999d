"""The tutorial's commands (docs/tutorial.md), taken from the page and run in order as a reader runs them: a folder
of real photographs trained, consolidated, exported, built on and deployed to three stand-in Jetson Orins.

The commands are the fenced `bash` blocks that follow a `<!-- test: tutorial -->` line, so the page and this test
cannot drift apart. What the page leaves to the reader is set up here: `my_photos/` (the Tux Paint photo folder of
tests/photos.py), `fleet.toml` (the stand-ins' inventory, with the page's target names) and the stand-in trtexec's
answer on the stored sample (a real engine computes it; the stand-in runs no model).

The commands run in this process, through the CLI's own app (typer's runner), in a fresh directory: starting Python
and importing torch for each of them would cost more than the quick suite's budget. The quick test trains one epoch
(`--set train.epochs=1` after the page's training command); the slow one runs the page as written and checks what the
page says `auto` chose.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from tests import photos
from tests.harness import JetsonFleet, fixtures

TUTORIAL = Path(__file__).resolve().parents[1] / "docs/tutorial.md"
MARK = "<!-- test: tutorial -->"
RUN_DIR = Path("artifacts/runs/photos")
jetson_fleet = fixtures.jetson_fleet

pytestmark = pytest.mark.skipif(
    not photos.available(), reason=f"needs Debian's {photos.PHOTO_PACKAGE} (make test installs it)"
)


def tutorial_commands(text: str) -> list[list[str]]:
    """argv of every command in the marked ```bash blocks, in page order: continuation lines joined, comments and
    the leading `pipeline` dropped."""
    commands = []
    for block in re.findall(rf"^{re.escape(MARK)}\n```bash\n(.*?)^```$", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                assert argv[0] == "pipeline", f"docs/tutorial.md: a tested block runs only `pipeline`: {line}"
                commands.append(argv[1:])
    return commands


def answer_correctly(fleet: JetsonFleet, run_dir: Path) -> None:
    """Make every device's stand-in trtexec export, on a load, the logits ONNX Runtime gave for the stored sample
    (what a correct engine computes), so the build's verification compares real numbers."""
    with np.load(run_dir / "onnx/sample.npz") as sample:
        logits = sample["logits"].tolist()
    for target in fleet:
        target.standins.set_trtexec(outputs={"logits": logits})


def run_tutorial(
    tmp_path: Path, fleet: JetsonFleet, monkeypatch: pytest.MonkeyPatch, *, train_more: list[str]
) -> dict[str, str]:
    """Run the page's commands in `tmp_path`, the training command with `train_more` appended; returns each
    command's output by its command line. Fails on the first command that does not exit 0."""
    commands = tutorial_commands(TUTORIAL.read_text())
    chain = [argv[0] if argv[0] not in ("deploy", "runs") else " ".join(argv[:2]) for argv in commands]
    for stage in ("train", "consolidate", "export", "build", "deploy run"):
        assert stage in chain, f"docs/tutorial.md: no tested `pipeline {stage}` command"
    photos.build(tmp_path / "my_photos")
    fleet.write_inventory(tmp_path / "fleet.toml")
    outputs = {}
    monkeypatch.chdir(tmp_path)  # the page's paths are relative to where the reader stands
    for argv in commands:
        if argv[0] == "build":
            answer_correctly(fleet, tmp_path / RUN_DIR)
        argv = [*argv, *train_more] if argv[0] == "train" else argv
        result = CliRunner().invoke(app, argv, env={"COLUMNS": "100"})
        line = shlex.join(["pipeline", *argv])
        assert result.exit_code == 0, f"$ {line}\n{result.output[-3000:]}\n{result.exception!r}"
        outputs[line] = result.output
    return outputs


def check_the_fleet_runs_it(tmp_path: Path, fleet: JetsonFleet, outputs: dict[str, str]) -> None:
    """What the page says the reader has at the end: every Orin on the run's release, with the engine of its class."""
    run_dir = tmp_path / RUN_DIR
    rows = json.loads((run_dir / "deploy/results.json").read_text())["targets"]
    assert [(r["target"], r["status"], r["device_class"]) for r in rows] == [
        (name, "ACTIVE", "orin-sm87-trt10.3.0") for name in ("orin-01", "orin-02", "orin-03")
    ]
    for row in rows:
        target = fleet[row["target"]]
        assert os.readlink(target.disk / "current") == f"releases/{row['release']}"
        assert (target.disk / "current/model.plan").is_file()
    assert (run_dir / "engines/orin-sm87-trt10.3.0/model.plan").is_file()
    assert "deployed (champion)" in outputs["pipeline runs list"]


def test_the_tutorial_commands_take_photos_to_three_orins(tmp_path: Path, jetson_fleet, monkeypatch) -> None:
    fleet = jetson_fleet(3)
    outputs = run_tutorial(tmp_path, fleet, monkeypatch, train_more=["--set", "train.epochs=1"])
    check_the_fleet_runs_it(tmp_path, fleet, outputs)


@pytest.mark.slow
def test_the_tutorial_as_written(tmp_path: Path, jetson_fleet, monkeypatch) -> None:
    """The page's commands as they are, and the numbers it quotes for `auto` on this folder."""
    fleet = jetson_fleet(3)
    outputs = run_tutorial(tmp_path, fleet, monkeypatch, train_more=[])
    check_the_fleet_runs_it(tmp_path, fleet, outputs)
    summary = json.loads((tmp_path / RUN_DIR / "train/summary.json").read_text())
    assert (summary["global_batch"], summary["epochs"], summary["lr"]) == (32, 30, 1e-2)
    for line in ("train.batch_size auto: 32", "train.epochs auto: 30", "train.lr auto: 0.01"):
        assert line in TUTORIAL.read_text()
