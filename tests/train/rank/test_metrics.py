"""metrics.jsonl across restarts."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.train.rank.metrics import MetricsLog


def _existing(path: Path) -> None:
    lines = [{"step": 1, "epoch": 0}, {"epoch": 0, "val_accuracy": 0.5}, {"step": 2, "epoch": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "ep')  # cut short by a crash


def test_resume_keeps_finished_epochs_and_drops_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _existing(path)
    with MetricsLog(path, start_epoch=1) as log:
        log.write({"step": 2, "epoch": 1, "loss": 0.1})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"step": 1, "epoch": 0},
        {"epoch": 0, "val_accuracy": 0.5},
        {"step": 2, "epoch": 1, "loss": 0.1},
    ]


def test_fresh_start_truncates(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _existing(path)
    with MetricsLog(path, start_epoch=0) as log:
        log.write({"step": 1, "epoch": 0})
    assert path.read_text() == '{"step": 1, "epoch": 0}\n'
