"""What the CLI asks of an SSH fleet at once: probe every device (`status`) and switch back (`rollback`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.deploy import remote
from pipeline.deploy.remote import FAILED, REFUSED, ROLLED_BACK, UNREACHABLE
from pipeline.fleet.inventory import Inventory, SshTarget
from pipeline.fleet.ssh import FAILURES, Device, HostKeyRefused, quiet_lost_connections


def status(inventory: Inventory) -> list[dict[str, Any]]:
    """One row per device: model, L4T, JetPack, TensorRT, device class, free space, hottest zone, links."""
    return asyncio.run(_gather(inventory, inventory.targets, _status_one))


def rollback(inventory: Inventory, name: str | None) -> list[dict[str, Any]]:
    """Make `previous` current again on one target (or all), through the previous release's own activate.sh."""
    return asyncio.run(_gather(inventory, inventory.select(name), _rollback_one))


async def _gather(inventory: Inventory, targets: list[SshTarget], each: Any) -> list[dict[str, Any]]:
    quiet_lost_connections()
    limit = asyncio.Semaphore(inventory.policy.max_parallel)

    async def one(target: SshTarget) -> dict[str, Any]:
        async with limit:
            try:
                return await asyncio.wait_for(each(inventory, target), timeout=inventory.policy.timeout_s)
            except HostKeyRefused as err:
                return {"target": target.name, "status": REFUSED, "reason": str(err)}
            except FAILURES as err:
                return {"target": target.name, "status": UNREACHABLE, "reason": f"{type(err).__name__}: {err}"}

    return list(await asyncio.gather(*(one(t) for t in targets)))


async def _status_one(inventory: Inventory, target: SshTarget) -> dict[str, Any]:
    started = time.perf_counter()
    async with Device(target, 30) as device:
        facts = await remote.probe(device)
    hottest = facts.max_temp_c
    return {
        "target": target.name,
        "status": "reachable",
        "model": facts.model or "?",
        "l4t": facts.l4t or "?",
        "jetpack": facts.jetpack or "?",
        "tensorrt": facts.tensorrt or "?",
        "class": facts.device_class,
        "free": f"{facts.free_bytes / 1e6:.0f} MB" if facts.free_bytes is not None else "?",
        "temp": f"{hottest:.1f} C" if hottest is not None else "?",
        "current": facts.current or "-",
        "previous": facts.previous or "-",
        "seconds": round(time.perf_counter() - started, 3),
    }


async def _rollback_one(inventory: Inventory, target: SshTarget) -> dict[str, Any]:
    async with Device(target, inventory.policy.timeout_s) as device:
        facts = await remote.probe(device)
        row = {"target": target.name, "status": FAILED, "current": facts.current, "previous": facts.previous}
        if not facts.current or not facts.previous:
            return {**row, "reason": "nothing to roll back to (no current and previous release)"}
        out = await device.run(remote.activate_command(target, facts.previous, inventory.policy.keep_releases))
    result = {**row, "release": facts.previous, "reason": ""}
    remote.apply_activation(out.stdout, out.tail(), result)
    if result["status"] == remote.ACTIVE:
        result |= {"status": ROLLED_BACK, "previous": facts.current}
    return {k: result[k] for k in ("target", "status", "current", "previous", "reason")}
