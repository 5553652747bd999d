"""The SSH job's entry points, called by the train stage: train on the devices (:func:`run_on_devices`) and the data
fingerprint when each device reads its own folder (:func:`node_data_fingerprint`). See :mod:`pipeline.train.cluster`
for the design: :mod:`~pipeline.train.cluster.job` runs the rounds, :mod:`~pipeline.train.cluster.node` holds one
device, :mod:`~pipeline.train.cluster.agent` is what runs there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pipeline import layout
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import read_json, write_json
from pipeline.fleet.inventory import Inventory, SshTarget, load_inventory
from pipeline.fleet.ssh import Device, Refused
from pipeline.train.cluster import (
    bounds,
    check_all,
    choose_backend,
    code_bundle,
    nodedata,
    python_path,
    refusal,
    refuse_unready,
)
from pipeline.train.cluster.agent import Printer
from pipeline.train.cluster.job import Job
from pipeline.train.rank import checkpoint


def run_on_devices(cfg: Config, run_dir: Path, output: Callable[[str], None] | None = None) -> None:
    """Train on the devices of `train.inventory`; the run directory ends as a local run's would.

    Ctrl-C, SIGTERM (a cancelled flow run) and `train.timeout_s` stop every rank on every device before this
    returns; a controller killed outright closes its SSH sessions, and each device's wrapper then does the same.
    """
    assert cfg.train.inventory is not None
    inventory = load_inventory(cfg.train.inventory)
    bounds(cfg.train.devices, len(inventory.targets))
    run_dir = Path(run_dir).resolve()
    checkpoint.resumable(run_dir / layout.CHECKPOINTS, cfg)
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
        asyncio.run(main_task(_train(cfg, run_dir, inventory, Path(tmp), Printer(output))))


def node_data_fingerprint(cfg: Config) -> str:
    """The run's data fingerprint when each device reads its own `data.path`: every device checked (and given the
    code, which reads the folder there), then one digest over every device's folder."""
    assert cfg.train.inventory is not None
    inventory = load_inventory(cfg.train.inventory)
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:

        async def collect() -> dict[str, nodedata.NodeData]:
            code = code_bundle(Path(tmp))
            checks = await check_all(inventory, code, Path(tmp))
            refuse_unready(checks)
            return await node_data([c.target for c in checks], cfg, code.id)

        return nodedata.combined(asyncio.run(collect()))


async def _train(cfg: Config, run_dir: Path, inventory: Inventory, workdir: Path, output: Printer) -> None:
    # A folder that cannot be sent is one line before any device is contacted.
    dataset = nodedata.dataset_bundle(cfg.data, workdir) if nodedata.sent(cfg) else None
    code = code_bundle(workdir)
    checks = await check_all(inventory, code, workdir)
    refuse_unready(checks, cfg.train.strategy)  # one line, exit 2, before anything starts anywhere
    backend = choose_backend(checks, cfg.train.backend)  # one for all: a mixed fleet's ranks must agree
    data_record: dict[str, Any] = {"mode": "sent", "id": dataset.id} if dataset is not None else {}
    if nodedata.node_local(cfg):
        data_record = nodedata.record(await node_data([c.target for c in checks], cfg, code.id))
    job = Job(cfg, run_dir, checks, code, workdir, output, dataset, backend)
    cluster, seconds = await _hosted(job, cfg.train.timeout_s)
    if data_record:
        cluster["data"] = data_record
    finish_summary(run_dir, cluster, seconds)


async def _hosted(job: Job, timeout_s: int) -> tuple[dict[str, Any], float]:
    """Run `job` within `timeout_s`, the rendezvous store hosted here for the whole of it, on loopback only: each
    device reaches it through its SSH connection (every agent is a client: is_host=0). Returns what the job adds to
    summary.json and its seconds."""
    from pipeline.train.rank import store  # torch: seconds to import, only once the devices are known to be ready

    rendezvous = store.serve("127.0.0.1")
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            cluster = await job.run(rendezvous.port)
    except TimeoutError:
        raise PipelineError(
            f"train.timeout_s: training still running after {timeout_s}s; stopped it on every device"
        ) from None
    finally:
        del rendezvous
    return cluster, time.monotonic() - started


async def node_data(targets: list[SshTarget], cfg: Config, code_id: str) -> dict[str, nodedata.NodeData]:
    """Every device's own dataset (node-local `data.path`), reported by the device with the controller's code."""

    async def one(target: SshTarget) -> nodedata.NodeData:
        try:
            async with Device(target, command_timeout_s=nodedata.FINGERPRINT_TIMEOUT_S) as dev:
                return await nodedata.report(dev, cfg.data, python_path(target, code_id))
        except Refused as err:
            raise refusal(target, err) from None

    found = await asyncio.gather(*(one(t) for t in targets))
    return nodedata.check_classes({t.name: n for t, n in zip(targets, found, strict=True)})


def finish_summary(run_dir: Path, cluster: dict[str, Any], seconds: float) -> None:
    """Add the cluster's record to summary.json and its events to metrics.jsonl."""
    summary = read_json(run_dir / layout.SUMMARY)
    write_json(run_dir / layout.SUMMARY, {**summary, **cluster, "seconds": round(seconds, 3)})
    with (run_dir / layout.METRICS).open("a") as fh:
        for event in cluster["events"]:
            fh.write(json.dumps(event) + "\n")


async def main_task(job: Awaitable[None]) -> None:
    """Run `job`, cancelled by SIGTERM as by Ctrl-C, so that its clean-up runs (main thread only: a Prefect task's
    thread gets the SSH sessions' own clean-up when its process dies)."""
    task = asyncio.ensure_future(job)
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    await task
