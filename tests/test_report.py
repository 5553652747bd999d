"""report.md and the Prefect artifact from a real run directory: curves that render where each is read, table rows
that stay one line however long a reason is, and the full reason below the table."""

import base64
import json
import re
from pathlib import Path

import pytest

from pipeline import report
from pipeline.config import load_config
from pipeline.manifest import RunDir, StageResult, create_run_dir

# What a build on a machine without TensorRT says, then a second class's reason, a pipe and an error's own lines.
LONG_REASON = (
    "no TensorRT: `import tensorrt` failed (ModuleNotFoundError: No module named 'tensorrt') and trtexec is not on "
    "PATH ('trtexec'); orin-jp6: not built: engine | plan mismatch\ntrtexec said:\n  [E] unsupported opset"
)


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """A run directory with two epochs of metrics, a done train stage and a build skipped for LONG_REASON."""
    run = create_run_dir(load_config(), tmp_path / "run")
    lines = [
        {"epoch": 0, "step": 1, "loss": 2.0},
        {"epoch": 0, "val_loss": 1.5, "val_accuracy": 0.5},
        {"epoch": 1, "step": 2, "loss": 1.0},
        {"epoch": 1, "val_loss": 0.9, "val_accuracy": 0.8},
    ]
    (run.path / "train").mkdir()
    (run.path / "train/metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run.record(StageResult("train", "done", metrics={"val_accuracy": 0.8}), {"seconds": 3.0})
    run.record(StageResult("build", "skipped", reason=LONG_REASON), {"seconds": 0.0})
    return run


@pytest.mark.parametrize(
    ("reason", "short"),
    [
        ("already active", "already active"),
        ("health check failed (argmax 3 != 5); rolled back to r1", "health check failed (argmax 3 != 5)…"),
        ("activate.sh: exit 1\nTraceback ...", "activate.sh: exit 1…"),
        # Over the limit: cut at a word, never inside brackets or a code span.
        (LONG_REASON, "no TensorRT: `import tensorrt` failed…"),
        ("x" * 100, "x" * report.SHORT_REASON + "…"),
    ],
)
def test_short_reason_is_the_first_clause(reason: str, short: str):
    assert report.short_reason(reason) == short
    assert len(report.short_reason(reason)) <= report.SHORT_REASON + 1


def test_report_md_links_the_curves_and_the_artifact_embeds_them(run: RunDir):
    text = report.write(run)
    assert (run.path / "report.md").read_text() == text
    # A plain viewer opens report.md beside report/: the link is relative and the file is there.
    (link,) = re.findall(r"!\[loss and accuracy\]\(([^)]+)\)", text)
    assert link == report.CURVES and (run.path / link).read_bytes().startswith(b"\x89PNG")

    embedded = report.markdown(run, embed_images=True)
    (uri,) = re.findall(r"!\[loss and accuracy\]\(([^)]+)\)", embedded)
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.removeprefix("data:image/png;base64,")) == (run.path / report.CURVES).read_bytes()
    assert len(embedded) < 200_000  # one small PNG: the artifact stays light for the API and the browser
    assert embedded.replace(uri, link) == text  # otherwise the same report


def test_long_reason_keeps_its_row_and_is_given_in_full_below(run: RunDir):
    text = report.markdown(run)
    table = text[: text.index("## Training")]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == ["stage", *report.STAGES]
    build = next(row for row in rows if row.startswith("| build |"))
    assert build == "| build | skipped |  | no TensorRT: `import tensorrt` failed… |"
    assert all(row.count(" | ") == 3 for row in rows)  # four cells each: no '|' or line break leaked in

    notes = table[table.index("Why, in full:") :]
    # Several lines: verbatim in a fenced block inside the list item, the pipe as written (it is not in a table).
    assert "- **build** skipped:\n\n  ```text\n  no TensorRT: `import tensorrt` failed (Module" in notes
    assert "engine | plan mismatch\n  trtexec said:\n    [E] unsupported opset\n  ```\n" in notes


def test_stage_rows_give_the_cell_and_the_full_reason(run: RunDir):
    rows = {row["stage"]: row for row in report.stage_rows(run)}
    assert rows["build"]["summary"] == report.short_reason(LONG_REASON)
    assert rows["build"]["reason"] == LONG_REASON
    assert rows["train"] | {"outputs": {}} == {
        "stage": "train",
        "status": "done",
        "seconds": 3.0,
        "summary": "val accuracy 0.8000",
        "reason": "",
        "outputs": {},
    }


def test_cli_table_shows_the_first_clause_and_the_reason_below(run: RunDir, capsys: pytest.CaptureFixture[str]):
    from rich.console import Console

    from pipeline.cli import STAGE_COLUMNS
    from pipeline.tables import print_rows

    print_rows(Console(width=80), report.stage_rows(run), STAGE_COLUMNS)
    out = capsys.readouterr().out
    table, below = out.split("\nbuild: ", 1)
    assert "no TensorRT: `import tensorrt` failed…" in table and "ModuleNotFoundError" not in table
    assert "no TensorRT" in below and "ModuleNotFoundError" in below and "[E] unsupported opset" in below
