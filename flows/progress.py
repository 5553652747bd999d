"""Training progress as a Prefect progress artifact, read from the metrics the ranks write.

Training runs in torchrun's processes, not in the task's: a small thread follows train/metrics.jsonl and moves
the artifact forward as epochs complete, so the Prefect UI shows progress without the ranks knowing about Prefect.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from pipeline.layout import METRICS
from pipeline.manifest import RunDir

POLL_S = 2.0


def epochs_done(run: RunDir) -> int:
    """Completed epochs so far: the epoch lines (those with val_accuracy) in train/metrics.jsonl."""
    path = run.path / METRICS
    if not path.exists():
        return 0
    return sum('"val_accuracy"' in line for line in path.read_text().splitlines())


def epochs_planned(run: RunDir, configured: int | str) -> int | None:
    """Epochs the run trains for: what the ranks resolved (each epoch line of train/metrics.jsonl says: `auto`
    epochs, or a set count that `compression = "auto"` scaled for DiLoCo), else `train.epochs` when set; None while
    neither is known."""
    path = run.path / METRICS
    lines = [line for line in path.read_text().splitlines() if '"val_accuracy"' in line] if path.exists() else []
    if lines:
        return int(json.loads(lines[-1])["epochs"])
    return configured if isinstance(configured, int) else None


@contextmanager
def training_progress(run: RunDir, epochs: int | str, enabled: bool = True) -> Iterator[None]:
    """Keep a progress artifact (0 to 100 %) in step with the run's completed epochs while the block runs."""
    if not enabled:
        yield
        return
    artifact_id = create_progress_artifact(0.0, key="training-progress", description=f"training run {run.path.name}")
    stop = threading.Event()

    def update() -> None:
        total = epochs_planned(run, epochs)
        if total:
            update_progress_artifact(artifact_id, 100.0 * min(epochs_done(run), total) / total)

    def follow() -> None:
        while not stop.wait(POLL_S):
            update()

    thread = threading.Thread(target=follow, name="training-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        update()
