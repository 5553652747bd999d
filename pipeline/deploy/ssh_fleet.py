"""What the CLI asks of all targets at once: what each one runs (`status`) and switching back (`rollback`).

SSH devices from an inventory and local targets (`local_status`, `local_rollback`) go through the same target-side
steps: the probe for the links, and the previous release's own activate.sh for a rollback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.config import Config, LocalTarget
from pipeline.deploy import remote
from pipeline.deploy.hosts import Host, LocalHost, local_spot
from pipeline.deploy.result import REFUSED, ROLLED_BACK, UNREACHABLE, Stop, TargetResult
from pipeline.errors import PipelineError
from pipeline.fleet.classes import DeviceClass
from pipeline.fleet.inventory import Inventory, Policy
from pipeline.fleet.ssh import FAILURES, Device, Refused, quiet_lost_connections
from pipeline.layout import CURRENT, RELEASES

Row = dict[str, Any]


def status(inventory: Inventory) -> list[Row]:
    """One row per device: model, L4T, JetPack, TensorRT, device class, free space, hottest zone, links."""
    return asyncio.run(_gather([Device(t, 30) for t in inventory.targets], inventory.policy, _status_one))


def rollback(inventory: Inventory, name: str | None) -> list[Row]:
    """Make `previous` current again on one target (or all), through the previous release's own activate.sh."""
    hosts = [Device(t, inventory.policy.timeout_s) for t in inventory.select(name)]
    keep = inventory.policy.keep_releases

    async def one(host: Host) -> Row:
        async with host:
            row = await remote.switch_back(host, keep)
        return {k: getattr(row, k) for k in ("target", "status", "current", "previous", "reason")}

    return asyncio.run(_gather(hosts, inventory.policy, one))


def local_status(cfg: Config) -> list[Row]:
    """One row per local target: current and previous release, how many are kept, whether current verifies."""
    return asyncio.run(_gather(_local_hosts(cfg, cfg.deploy.targets), Policy(), _local_status_one))


def local_rollback(cfg: Config, target_name: str | None) -> list[Row]:
    """Make `previous` current again on one local target (or all), through its activate.sh; every target is
    checked before any is switched."""
    hosts = _local_hosts(cfg, _select(cfg, target_name))
    return asyncio.run(_local_rollback(hosts, cfg.deploy.keep_releases))


async def _gather(hosts: list[Host], policy: Policy, each: Callable[[Host], Awaitable[Row]]) -> list[Row]:
    quiet_lost_connections()
    limit = asyncio.Semaphore(policy.max_parallel)

    async def one(host: Host) -> Row:
        async with limit:
            try:
                return await asyncio.wait_for(each(host), timeout=policy.timeout_s)
            except Stop as stop:  # the probe failed
                return {"target": host.target.name, "status": stop.status, "reason": stop.reason}
            except Refused as err:
                return {"target": host.target.name, "status": REFUSED, "reason": str(err)}
            except FAILURES as err:
                return {"target": host.target.name, "status": UNREACHABLE, "reason": f"{type(err).__name__}: {err}"}

    return list(await asyncio.gather(*(one(h) for h in hosts)))


async def _status_one(host: Host) -> Row:
    started = time.perf_counter()
    async with host:
        facts = await remote.probe(host)
    hottest = facts.max_temp_c
    return {
        "target": host.target.name,
        "status": "reachable",
        "model": facts.model or "?",
        "l4t": facts.l4t or "?",
        "jetpack": facts.jetpack or "?",
        "tensorrt": facts.tensorrt or "?",
        "class": str(DeviceClass.probed(facts)),
        "free": f"{facts.free_bytes / 1e6:.0f} MB" if facts.free_bytes is not None else "?",
        "temp": f"{hottest:.1f} C" if hottest is not None else "?",
        "current": facts.current or "-",
        "previous": facts.previous or "-",
        "seconds": round(time.perf_counter() - started, 3),
    }


def _local_hosts(cfg: Config, targets: list[LocalTarget]) -> list[Host]:
    return [LocalHost(local_spot(t, cfg.deploy)) for t in targets]


async def _local_status_one(host: Host) -> Row:
    root = host.target.root
    async with host:
        facts = await remote.probe(host)
        problem = await remote.verified(host, f"{root}/{CURRENT}") if facts.current else "no current release"
        releases = len(await remote.releases_on(host))
    row = {"target": host.target.name, "root": root, "current": facts.current or "-"}
    return row | {"previous": facts.previous or "-", "releases": releases, "verified": problem or "yes"}


async def _local_rollback(hosts: list[Host], keep: int) -> list[Row]:
    for host in hosts:
        async with host:
            await _check_rollback(host)
    rows = []
    for host in hosts:
        async with host:
            rows.append(await remote.switch_back(host, keep))
    return [
        {"target": r.target, "status": r.status, "current": r.current, "previous": r.previous, "health": _verdict(r)}
        for r in rows
    ]


async def _check_rollback(host: Host) -> None:
    """PipelineError unless the target has a current and a previous release, and the previous one verifies."""
    name, root = host.target.name, host.target.root
    facts = await remote.probe(host)
    if not facts.current or not facts.previous:
        raise PipelineError(f"{name}: nothing to roll back to ({root} has no current and previous release)")
    problem = await remote.verified(host, f"{root}/{RELEASES}/{facts.previous}")
    if problem is not None:
        raise PipelineError(f"{name}: previous release {facts.previous} fails verification: {problem}")


def _verdict(row: TargetResult) -> str:
    if row.status == ROLLED_BACK and row.health.get("passed"):
        return "passed"
    return f"failed: {row.reason or row.health.get('reason', 'no health verdict')}"


def _select(cfg: Config, target_name: str | None) -> list[LocalTarget]:
    if target_name is None:
        return list(cfg.deploy.targets)
    chosen = [t for t in cfg.deploy.targets if t.name == target_name]
    if not chosen:
        known = ", ".join(t.name for t in cfg.deploy.targets) or "none"
        raise PipelineError(f"deploy.targets: no target named {target_name!r} (known: {known})")
    return chosen
