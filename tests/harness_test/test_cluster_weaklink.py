"""The cluster benchmark's time to accuracy: from a run's metrics lines and the watcher's samples to the seconds and
bytes until none's final accuracy, the ratios against none, issue #31's verdict and the docs table's columns."""

from __future__ import annotations

from typing import Any

import pytest

from benchmark_tables import train_cluster_weaklink as table
from benchmarks.train_cluster_weaklink import Sample, accuracy_curve, score, validations_seen

START = 1000.0


def metrics(accuracies: list[float], bytes_per_step: int, steps_per_epoch: int = 2) -> list[dict[str, Any]]:
    """metrics.jsonl records as rank 0 writes them: each epoch's step lines, then its validation line."""
    records: list[dict[str, Any]] = []
    for epoch, accuracy in enumerate(accuracies):
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i + 1
            records.append({"step": step, "epoch": epoch, "comm_bytes": bytes_per_step, "batch": 64})
        records.append({"epoch": epoch, "epochs": len(accuracies), "val_accuracy": accuracy, "val_loss": 1.0})
    return records


def run(method: str, accuracies: list[float], bytes_per_step: int, s_per_epoch: float) -> dict[str, Any]:
    """A row as `train()` returns it: every epoch's validation seen `s_per_epoch` apart, the link carrying 1 MB a
    second."""
    seen = [(s_per_epoch * (k + 1), int(1e6 * s_per_epoch * (k + 1))) for k in range(len(accuracies))]
    row = {"run": method, "method": method, "s_per_step": s_per_epoch / 2, "val_accuracy": accuracies[-1]}
    return row | {"curve": accuracy_curve(metrics(accuracies, bytes_per_step), seen)}


def test_the_validations_are_timed_from_the_log_appearing_and_the_bytes_counted_from_then() -> None:
    samples = [
        Sample(START - 5, 0, 0, {}),  # before this run started: not counted
        Sample(START + 1, 100, 50, {}),  # the upload, rendezvous: no log yet
        Sample(START + 3, 200, 100, {"node-1": (7, 0, 0)}),  # training starts
        Sample(START + 4, 300, 200, {"node-1": (7, 2, 1)}),
        Sample(START + 9, 900, 400, {"node-1": (7, 4, 2), "node-2": (8, 0, 0)}),
    ]
    assert validations_seen(samples, START) == [(1.0, 200), (6.0, 1000)]


def test_each_validation_gets_the_bytes_sent_before_it_and_its_seen_time() -> None:
    curve = accuracy_curve(metrics([0.5, 0.9], bytes_per_step=10), [(1.5, 111), (3.0, 222)])
    assert curve == [
        {"epoch": 0, "step": 2, "val_accuracy": 0.5, "comm_bytes": 20, "wall_s": 1.5, "link_bytes": 111},
        {"epoch": 1, "step": 4, "val_accuracy": 0.9, "comm_bytes": 40, "wall_s": 3.0, "link_bytes": 222},
    ]
    with pytest.raises(ValueError):  # a validation the watcher never saw: a benchmark bug, not a number
        accuracy_curve(metrics([0.5, 0.9], bytes_per_step=10), [(1.5, 111)])
    settled = metrics([0.5, 0.9], bytes_per_step=10)
    settled[2]["comm_bytes"] = 7  # the averaging before the first validation, on its epoch line
    assert [p["comm_bytes"] for p in accuracy_curve(settled, [(1.5, 111), (3.0, 222)])] == [27, 47]


def test_time_and_bytes_to_nones_final_accuracy_against_nones_and_the_verdict() -> None:
    rows = [
        run("none", [0.5, 0.8, 0.9, 0.95, 0.94], bytes_per_step=1000, s_per_epoch=10),  # target 0.94, reached at 4
        run("diloco", [0.6, 0.94, 0.95, 0.95, 0.96], bytes_per_step=40, s_per_epoch=6),  # at 2
        run("topk", [0.5, 0.6, 0.7, 0.8, 0.9], bytes_per_step=100, s_per_epoch=5),  # never
        run("auto", [0.5, 0.6, 0.94, 0.95, 0.95], bytes_per_step=30, s_per_epoch=4),  # at 3
    ]
    result = score(rows, methods=4)
    none, diloco, topk, auto = rows
    assert result["target_accuracy"] == 0.94
    assert none["to_target"]["epoch"] == 3 and none["to_target_vs_none"] == {
        k: 1.0 for k in diloco["to_target_vs_none"]
    }
    assert diloco["to_target"] == {
        "epoch": 1, "step": 4, "val_accuracy": 0.94, "comm_bytes": 160, "wall_s": 12.0, "link_bytes": 12_000_000,
    }  # fmt: skip
    assert diloco["to_target_vs_none"] == pytest.approx({"wall_s": 0.3, "comm_bytes": 0.02, "link_bytes": 0.3})
    assert topk["to_target"] is None and topk["to_target_vs_none"] is None
    verdict = result["time_to_accuracy"]
    assert verdict["best"] == "diloco" and verdict["auto_vs_best"] == pytest.approx(1.0) and verdict["met"]
    auto["curve"] = auto["curve"][:2]  # auto short of it: the verdict cannot be met
    assert score(rows, methods=4)["time_to_accuracy"]["met"] is False
    result["runs"] = rows
    for r in rows:
        r |= {"bytes_per_step": 1, "bytes_sent": {"code": 0, "data": 0}, "link_bytes": {"training": {"tx": 1, "rx": 1}}}
    lines = table(result).splitlines()
    assert "| 12 s (0.30x) | 0.00 MB (0.02x) | 12.0 MB (0.30x) |" in lines[3]
    assert lines[4].endswith("| never | never | never |")
