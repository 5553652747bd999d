"""Rank 0's training log, train/metrics.jsonl: one JSON object per line, each line flushed as it is written."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline.files import write_text


def _kept(record: dict[str, Any], start_epoch: int, start_step: int | None) -> bool:
    if start_step is not None and "step" in record:
        return bool(record["step"] <= start_step)
    return bool(record.get("epoch", start_epoch) < start_epoch)


def _kept_lines(path: Path, start_epoch: int, start_step: int | None) -> list[str]:
    """Lines of completed epochs before `start_epoch` (and, given `start_step`, of steps up to it); what a crash
    left after the checkpoint is dropped."""
    if (start_epoch == 0 and not start_step) or not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and _kept(record, start_epoch, start_step):
            kept.append(line)
    return kept


class MetricsLog:
    """Append-only JSON-lines writer that, on resume, keeps exactly the lines of the epochs (and steps) done."""

    def __init__(self, path: Path, start_epoch: int, start_step: int | None = None) -> None:
        write_text(path, "".join(f"{line}\n" for line in _kept_lines(path, start_epoch, start_step)))
        self._fh = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a line."""
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._fh.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
