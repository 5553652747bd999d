"""Checkpoints copied back from a device to the controller, through the real `Node` over SSH to one stand-in Jetson
(tests/harness): a device that offers hostile file names, and the durability of what is copied before `latest` moves.

No training runs here: the device's checkpoint is a real (tiny) DCP checkpoint written by the test onto its disk.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipeline import layout
from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.fleet import upload
from pipeline.fleet.inventory import SshTarget, load_inventory
from pipeline.fleet.ssh import LINK_TIMEOUT_S
from pipeline.train.cluster import NodeCheck
from pipeline.train.cluster import node as node_module
from pipeline.train.cluster.agent import Printer
from pipeline.train.cluster.job import Job
from pipeline.train.cluster.node import Node
from pipeline.train.rank import checkpoint
from tests import durability
from tests.harness import JetsonFleet, JetsonTarget, TargetSpec, fixtures

jetson_fleet = fixtures.jetson_fleet
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save, no ranks
STEP = "step-3"


def one_device(jetson_fleet: Callable[..., JetsonFleet]) -> tuple[JetsonTarget, SshTarget]:
    """One stand-in on the loopback (no Python needed there: the controller only lists and fetches files)."""
    fleet = jetson_fleet([TargetSpec("node-1")])
    return fleet["node-1"], load_inventory(fleet.write_inventory()).targets[0]


def device_checkpoint(device: JetsonTarget, key: str, scratch: Path, step: int = 3) -> str:
    """A complete checkpoint `step-<step>` in the device's run directory `key`, `latest` on it; returns its device
    path."""
    name = f"step-{step}"
    source = scratch / name
    dcp.save({"model": {"w": torch.arange(4.0)}}, checkpoint_id=source, no_dist=True)
    write_json(source / checkpoint.TRAINER_JSON, {"epoch": 0, "step": step})
    torch.save(torch.get_rng_state(), source / "rng-0.pt")
    ckpts = device.disk / "train/runs" / key / layout.CHECKPOINTS
    shutil.copytree(source, ckpts / name)
    (ckpts / "latest").unlink(missing_ok=True)
    (ckpts / "latest").symlink_to(name)
    return f"{device.deploy_root}/train/runs/{key}/{layout.CHECKPOINTS}/{name}"


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def test_a_device_offering_a_climbing_file_name_is_named_and_nothing_is_written(jetson_fleet, tmp_path: Path):
    """A compromised device's `ls` lists `../../../../escaped` (or an absolute path on the controller) beside a real
    file, and serves those paths: the controller names the device and writes nothing, neither there nor in `part`."""
    device, target = one_device(jetson_fleet)
    where = device_checkpoint(device, "job", tmp_path)
    controller = tmp_path / "controller"
    part = controller / "run" / layout.CHECKPOINTS / f".{STEP}.part"
    part.mkdir(parents=True)
    for hostile in ("../../../../escaped", f"{controller}/absolute"):
        served = posixpath.normpath(f"{where}/{hostile}")
        device.run(f"mkdir -p {posixpath.dirname(served)} && echo planted >{served}")
        device.run(
            "cat >/usr/local/bin/ls && chmod 755 /usr/local/bin/ls",
            input=f"#!/bin/sh\nprintf '%s\\n' {checkpoint.TRAINER_JSON} '{hostile}'\n",
        )
        with pytest.raises(
            PipelineError,
            match=rf"^node-1: offered checkpoint file {re.escape(repr(hostile)[:40])}.* for {STEP}: not a plain",
        ):
            asyncio.run(_get_checkpoint(target, part))
        assert files_under(controller) == []


async def _get_checkpoint(target: SshTarget, part: Path) -> None:
    node = await Node.connect(NodeCheck(target), "job", 1, LINK_TIMEOUT_S)  # port 1: no store, files only
    try:
        await node.get_checkpoint(STEP, part)
    finally:
        await node.close()


def test_a_checkpoint_copied_back_is_on_disk_before_latest_moves(jetson_fleet, tmp_path: Path):
    """Under strace (this process): each copied file is fsynced before its rename into `.step-3.part`, the part
    fsynced after its last entry, renamed, the checkpoints directory fsynced, and only then `latest` switched."""
    device, target = one_device(jetson_fleet)
    job = Job(
        validate({}, "test"), tmp_path / "run", [NodeCheck(target)], upload.bundle("none", {}), tmp_path, Printer(None)
    )
    device_checkpoint(device, job.key, tmp_path)
    log = tmp_path / "collect.strace"

    async def collect() -> None:
        node = await Node.connect(NodeCheck(target), job.key, 1, LINK_TIMEOUT_S)
        try:
            with durability.attached(os.getpid(), log):
                await job._collect_newest([node])
        finally:
            await node.close()

    asyncio.run(collect())
    assert checkpoint.latest(job.ckpt_root) == (job.ckpt_root / STEP).resolve()
    assert files_under(job.ckpt_root / STEP) == [".metadata", "__0_0.distcp", "rng-0.pt", checkpoint.TRAINER_JSON]
    assert job.ckpt_root / STEP in durability.published(log, job.ckpt_root)  # the trace saw the copy
    assert durability.unsynced_publishes(log, job.ckpt_root) == []


def test_while_a_round_runs_copies_leave_the_link_nine_tenths_of_the_time(jetson_fleet, tmp_path: Path):
    """A device that saves after every outer step: the controller copies a new checkpoint while the round runs only
    once the copies so far took at most a tenth of the time since; at the round's end (not paced), at once."""
    device, target = one_device(jetson_fleet)
    job = Job(
        validate({}, "test"), tmp_path / "run", [NodeCheck(target)], upload.bundle("none", {}), tmp_path, Printer(None)
    )

    took: list[float] = []

    async def collect(paced: bool) -> int:
        node = await Node.connect(NodeCheck(target), job.key, 1, LINK_TIMEOUT_S)
        try:
            start = time.monotonic()
            await job._collect_newest([node], paced=paced)
            took[:] = [start, time.monotonic()]
        finally:
            await node.close()
        return job.resumed_step()

    device_checkpoint(device, job.key, tmp_path)
    assert asyncio.run(collect(paced=True)) == 3  # the first: nothing copied yet
    start, end = took
    assert end < job.next_copy <= end + 9 * (end - start)  # the next waits nine times as long as the copy took
    device_checkpoint(device, job.key, tmp_path, step=5)
    job.next_copy = time.monotonic() + 3600  # a copy that took 400 s, as a large checkpoint over 20 Mbit/s can
    assert asyncio.run(collect(paced=True)) == 3
    assert asyncio.run(collect(paced=False)) == 5
    device_checkpoint(device, job.key, tmp_path, step=7)
    job.next_copy = time.monotonic()  # as if the time had passed
    assert asyncio.run(collect(paced=True)) == 7


def test_a_checkpoint_is_copied_from_a_device_that_committed_it_not_from_one_still_writing_it(
    jetson_fleet, tmp_path: Path
):
    """Each device saves its own (DDP over SSH): node-2 is still writing step 3 (its data file half there, its RNG
    file whole) when node-1 has committed it. While the round runs, the copy waits for node-2; at the round's end,
    node-2, asked first, gives only its RNG file, and the data is node-1's."""
    fleet = jetson_fleet([TargetSpec("node-1"), TargetSpec("node-2")])
    targets = load_inventory(fleet.write_inventory()).targets
    job = Job(
        validate({}, "test"), tmp_path / "run", [NodeCheck(t) for t in targets], upload.bundle("none", {}), tmp_path,
        Printer(None),
    )  # fmt: skip
    device_checkpoint(fleet["node-1"], job.key, tmp_path)
    writing = fleet["node-2"].disk / "train/runs" / job.key / layout.CHECKPOINTS / STEP
    writing.mkdir(parents=True)
    whole = (tmp_path / STEP / "__0_0.distcp").read_bytes()
    (writing / "__0_0.distcp").write_bytes(whole[: len(whole) // 2])
    torch.save(torch.get_rng_state(), writing / "rng-1.pt")

    async def collect(paced: bool) -> None:
        nodes = [await Node.connect(NodeCheck(t), job.key, 1, LINK_TIMEOUT_S) for t in reversed(targets)]
        try:
            await job._collect_newest(nodes, paced=paced)  # node-2 first
        finally:
            for node in nodes:
                await node.close()

    asyncio.run(collect(paced=True))  # while the round runs, it waits until every device has committed it
    assert checkpoint.latest(job.ckpt_root) is None and not (job.ckpt_root / STEP).exists()
    asyncio.run(collect(paced=False))  # the round's end (node-2 lost, say) takes what there is
    assert checkpoint.latest(job.ckpt_root) == (job.ckpt_root / STEP).resolve()
    assert (job.ckpt_root / STEP / "__0_0.distcp").read_bytes() == whole
    assert files_under(job.ckpt_root / STEP) == [
        ".metadata", "__0_0.distcp", "rng-0.pt", "rng-1.pt", checkpoint.TRAINER_JSON
    ]  # fmt: skip


@pytest.mark.parametrize("line", ['{"step": "9"}', "{not json}", "[1, 2]", '{"step": 1e99}', "[" * 5000 + "]" * 5000])
def test_a_metrics_line_from_a_device_that_is_not_a_step_counts_for_nothing(line: str) -> None:
    assert node_module._metrics_step(line) == -1
    assert node_module._metrics_step('{"step": 12, "loss": 0.5}') == 12
