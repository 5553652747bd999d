"""Devices leaving and coming back during cluster training, under DDP and FSDP, against stand-in Jetsons.

A device is killed outright (its whole stand-in: every process and connection gone, as at a power cut) and then
booted again with its disk as it was; the controller takes it back in at the next checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.files import read_json
from pipeline.train.cluster import run_key
from tests.train.cluster.test_cluster import (
    forwarding,
    inventory,
    jetson_fleet,
    marked_processes,
    pipeline_cmd,
    start_cluster,
)

__all__ = ["forwarding", "jetson_fleet"]  # fixtures, used by name

ELASTIC = ("--set", "train.devices=2:3", "--set", "train.checkpoint_every_steps=10")


class Output:
    """The controller's output, read line by line in the background, so a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if found := [line for line in list(self.lines) if text in line]:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r} in the controller's output:\n{''.join(self.lines[-40:])}")

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_device_that_comes_back_rejoins(jetson_fleet, forwarding, tmp_path: Path, strategy: str) -> None:
    """node-2 dies once the controller holds a checkpoint and boots again once the others go on without it: it is
    taken back in, the run finishes on all three, and summary.json and metrics.jsonl record the leave and the join
    with the steps each cost. Under FSDP every round reshards the controller's complete checkpoint (3 → 2 → 3
    ranks): the dead device's shards were copied back before it died."""
    fleet = start_cluster(jetson_fleet, 3)
    inv = inventory(fleet)
    run_dir = tmp_path / "run"
    args = ("--set", "train.epochs=8", "--set", f"train.strategy={strategy}", *ELASTIC)
    proc = subprocess.Popen(
        pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *args),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(proc)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / layout.LATEST).is_symlink() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        killed_at = time.time()
        fleet["node-2"].kill()
        output.wait_for("round 2: node-1, node-3", proc)
        fleet["node-2"].restart()
        output.wait_for("round 3: node-1, node-3, node-2", proc)
        proc.wait(timeout=600)
    finally:
        proc.kill()
    text = output.text()
    assert proc.returncode == 0, text[-4000:]
    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["world_size"] == 3 and sorted(summary["nodes"]) == ["node-1", "node-2", "node-3"]
    assert summary["rounds"] == 3 and summary["val_accuracy"] >= 0.9, summary
    left, joined = summary["events"]
    assert (left["event"], left["node"], joined["event"], joined["node"]) == ("left", "node-2", "joined", "node-2")
    assert killed_at <= left["time"] <= joined["time"]
    assert 0 < left["resumed_step"] <= left["at_step"] and left["steps_lost"] == left["at_step"] - left["resumed_step"]
    # Taken in at a checkpoint newer than its return: lost are only the steps the others ran past it meanwhile.
    assert joined["resumed_step"] > left["resumed_step"]
    assert joined["steps_lost"] == joined["at_step"] - joined["resumed_step"] >= 0
    events = [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()[-2:]]
    assert [(e["event"], e["node"], e["steps_lost"]) for e in events] == [
        ("left", "node-2", left["steps_lost"]),
        ("joined", "node-2", joined["steps_lost"]),
    ]
    latest = run_dir / layout.LATEST
    assert sorted(p.name for p in latest.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt", "rng-2.pt"]
    assert marked_processes(fleet) == []


@pytest.mark.slow
def test_losing_the_device_that_runs_rank_0_loses_no_checkpoint_the_others_committed(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    """Under DDP each device commits a whole checkpoint of its own: rank 0's device is killed as soon as another
    device has committed one, before the controller may have copied it, and training goes on from it (or from a newer
    one the controller copied in time), not from an older one."""
    fleet = start_cluster(jetson_fleet, 3)
    run_dir = tmp_path / "run"
    args = ("--set", "train.epochs=8", "--set", "train.strategy=ddp", *ELASTIC)
    proc = subprocess.Popen(
        pipeline_cmd("train", "--inventory", str(inventory(fleet)), "--run-dir", str(run_dir), *args),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = Output(proc)
    runs = {t.name: t.disk / "train/runs" / run_key(run_dir.resolve()) for t in fleet}
    try:
        deadline = time.monotonic() + 300
        held: dict[str, str] = {}
        while not held and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            # Round 1: only the device of rank 0 has metrics.jsonl (the controller has none to send yet).
            first = [name for name, run in runs.items() if (run / layout.METRICS).is_file()]
            pointers = {name: run / layout.LATEST for name, run in runs.items() if name not in first}
            held = {name: os.readlink(p) for name, p in pointers.items() if first and p.is_symlink()}
        assert held, output.text()[-4000:]
        fleet[first[0]].kill()
        proc.wait(timeout=600)
    finally:
        proc.kill()
    text = output.text()
    assert proc.returncode == 0, text[-4000:]
    (left,) = read_json(run_dir / layout.SUMMARY)["events"]
    assert left["node"] == first[0]
    assert left["resumed_step"] >= min(int(p.removeprefix("step-")) for p in held.values()) > 0
