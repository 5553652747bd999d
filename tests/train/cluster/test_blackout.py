"""A device's link blacking out during cluster training, against stand-in Jetsons (tests/harness): within
`train.link_timeout_s` it is weather (the round rides it out, every rank waiting in its collective), past it the
device is gone (it leaves, the others go on).

The blackout is `DeviceLink.cut()`: the device's end goes down, every packet either way is dropped and the device's
routes through it go with it. `heal()` brings the end back; the route to the other devices is put back as a device's
network manager would once its WiFi is back.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.config import load_config
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.fleet.inventory import load_inventory
from pipeline.train.cluster import NodeCheck
from pipeline.train.cluster.node import Node
from pipeline.train.rank import checkpoint
from tests.harness.jetsons import JetsonTarget
from tests.train.cluster.test_cluster import (
    forwarding,
    inventory,
    jetson_fleet,
    marked_processes,
    pipeline_cmd,
    run_cli,
    start_cluster,
)
from tests.train.cluster.test_cluster_elastic import Output

__all__ = ["forwarding", "jetson_fleet"]  # fixtures, used by name

ARGS = ("--set", "train.epochs=4", "--set", "train.devices=1:2", "--set", "train.checkpoint_every_steps=10")
BLACKOUT_S = 90.0
"""Over a minute, and past the 60 s torch's rendezvous gives a store operation by default: the agent of a device
blacked out that long died of it while the job still waited for the device."""


def test_pg_timeout_below_the_link_timeout_is_refused_in_one_line() -> None:
    """Ranks that gave up on a silent peer before the job does would end the round the job means to ride out."""
    with pytest.raises(PipelineError) as err:
        load_config(None, ['train.inventory="fleet.toml"', "train.pg_timeout_s=60"])
    assert "train.pg_timeout_s (60) is below train.link_timeout_s (120)" in str(err.value)
    assert "\n" not in str(err.value)
    assert load_config(None, ['train.inventory="f.toml"', "train.pg_timeout_s=60", "train.link_timeout_s=60"])
    assert load_config(None, ["train.pg_timeout_s=60"]).train.link_timeout_s == 120  # no link without devices


def cut(target: JetsonTarget) -> float:
    """Black out `target`'s link; returns when (monotonic)."""
    assert target.link is not None
    target.link.cut()
    return time.monotonic()


def heal(target: JetsonTarget) -> None:
    """End `target`'s blackout: its link back up, its route to the other devices with it."""
    assert target.link is not None
    target.link.heal()
    target.link.in_device(f"ip route replace 10.213.0.0/16 via {target.link.host_ip}")


def test_a_device_silent_for_less_than_the_link_timeout_is_still_there(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    """Cut for 20 s under a link timeout of 40 s, the device keeps its connection, and the controller's question
    whether it is still there waits for the answer (it was "gone" after 15 s)."""
    fleet = start_cluster(jetson_fleet, 1)
    target = load_inventory(inventory(fleet)).targets[0]

    async def ask_through_a_blackout() -> tuple[bool, float, bool]:
        node = await Node.connect(NodeCheck(target), "blackout", 1, link_timeout_s=40)  # port 1: no store
        try:
            began = cut(fleet["node-1"])
            loop = asyncio.get_running_loop()
            loop.call_later(20, heal, fleet["node-1"])
            alive = await node.alive()
            answered_after = time.monotonic() - began
            return alive, answered_after, (await node.dev.run("true")).ok
        finally:
            await node.close()

    alive, answered_after, same_connection = asyncio.run(ask_through_a_blackout())
    assert alive and answered_after >= 20 and same_connection


def latest_step(run_dir: Path) -> int:
    """Step of the controller's latest complete checkpoint; -1 before the first."""
    found = checkpoint.latest(run_dir / layout.CHECKPOINTS)
    return checkpoint.read_meta(found)["step"] if found else -1


def wait_for_step(run_dir: Path, above: int, proc: subprocess.Popen[str], timeout_s: float = 300) -> float:
    """Wait until the controller holds a checkpoint past step `above`; returns when (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while latest_step(run_dir) <= above:
        assert time.monotonic() < deadline and proc.poll() is None, f"no checkpoint past step {above}"
        time.sleep(0.2)
    return time.monotonic()


def start_training(inv: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen[str], Output]:
    """The SSH job on `inv` in the background, its output read as it comes."""
    proc = subprocess.Popen(
        pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *ARGS, *extra),
        cwd=run_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, Output(proc)


@pytest.mark.slow  # two runs of the quickstart on two stand-ins, one with a blackout of 90 s: minutes
def test_a_blackout_within_the_link_timeout_is_ridden_out_in_the_same_round(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    """node-2's link is cut for 90 s (`train.link_timeout_s` is 120) once the controller holds a checkpoint:
    training waits for it and goes on from where it stood, in the same round, to the accuracy of a run without the
    blackout."""
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    # 4 epochs train in 3 s here, less than it takes the controller to hold its first checkpoint: 24 are still
    # training when the cut comes.
    longer = ("--set", "train.epochs=24")
    began = time.monotonic()
    straight = run_cli(
        "train", "--inventory", str(inv), "--run-dir", str(tmp_path / "straight"), *ARGS, *longer, cwd=tmp_path
    )
    straight_s = time.monotonic() - began
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_dir = tmp_path / "blackout"
    began = time.monotonic()
    proc, output = start_training(inv, run_dir, *longer)
    try:
        wait_for_step(run_dir, 0, proc)
        cut_at = cut(fleet["node-2"])
        time.sleep(BLACKOUT_S)
        stood_at = latest_step(run_dir)
        heal(fleet["node-2"])
        moving_at = wait_for_step(run_dir, stood_at, proc)
        proc.wait(timeout=600)
    finally:
        proc.kill()
    text = output.text()
    assert proc.returncode == 0, text[-4000:]
    print(
        f"blackout {BLACKOUT_S:.0f} s: a new checkpoint {moving_at - cut_at:.0f} s after the cut; "
        f"run {time.monotonic() - began:.0f} s against {straight_s:.0f} s undisturbed"
    )
    summary = read_json(run_dir / layout.SUMMARY)
    reference = read_json(tmp_path / "straight" / layout.SUMMARY)
    assert summary["rounds"] == 1 and summary["events"] == [], summary
    assert summary["nodes"] == ["node-1", "node-2"] and summary["world_size"] == reference["world_size"]
    assert abs(summary["val_accuracy"] - reference["val_accuracy"]) <= 0.01, (summary, reference)
    assert marked_processes(fleet) == []


@pytest.mark.slow  # the quickstart on two stand-ins, then on one: minutes
def test_a_blackout_longer_than_the_link_timeout_makes_the_device_leave(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    """With `train.link_timeout_s = 20`, node-2 stays cut: it leaves no sooner than 20 s after the cut, node-1 goes on
    alone from the controller's checkpoint and finishes; once node-2 is back, nothing of the old round runs there."""
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    run_dir = tmp_path / "run"
    proc, output = start_training(inv, run_dir, "--set", "train.link_timeout_s=20")
    try:
        wait_for_step(run_dir, 0, proc)
        cut_at, cut_time = cut(fleet["node-2"]), time.time()
        output.wait_for("round 2: node-1, from step", proc)
        left_after = time.monotonic() - cut_at
        heal(fleet["node-2"])
        proc.wait(timeout=600)
    finally:
        proc.kill()
    text = output.text()
    assert proc.returncode == 0, text[-4000:]
    print(f"link_timeout_s 20: node-2 left {left_after:.0f} s after the cut")
    summary = read_json(run_dir / layout.SUMMARY)
    left = summary["events"][0]
    assert (left["event"], left["node"]) == ("left", "node-2") and 20 <= left["time"] - cut_time < 60, summary
    assert summary["val_accuracy"] >= 0.9, summary
    assert marked_processes(fleet) == []
