"""report.md and the Prefect artifact from a real run directory: curves that render where each is read."""

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
