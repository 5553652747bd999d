"""A fleet rollout: the canary alone first, then waves; stop when the canary fails or too many targets failed.

Within a wave targets run concurrently, never more than `policy.max_parallel` connections at once. Targets after
a stop are reported SKIPPED (their devices untouched).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pipeline.deploy import remote
from pipeline.deploy.release import Releases
from pipeline.deploy.result import TargetResult
from pipeline.fleet.inventory import Inventory, SshTarget
from pipeline.fleet.ssh import Device, quiet_lost_connections


def waves(inventory: Inventory) -> list[list[SshTarget]]:
    """The canary wave (if any), then the other targets in inventory order, `wave_size` at a time."""
    policy, targets = inventory.policy, inventory.targets
    if isinstance(policy.canary, list):
        canary = [t for t in targets if t.name in policy.canary]
    else:
        canary = targets[: policy.canary]
    rest = [t for t in targets if t not in canary]
    chunks = [rest[i : i + policy.wave_size] for i in range(0, len(rest), policy.wave_size)]
    return ([canary] if canary else []) + chunks


def plan_rows(inventory: Inventory) -> list[dict[str, Any]]:
    """One row per target: the wave it is in (0 = canary when there is one) and where it is."""
    rows = []
    has_canary = bool(waves(inventory)) and bool(inventory.policy.canary)
    for number, wave in enumerate(waves(inventory), start=0 if has_canary else 1):
        for target in wave:
            label = "canary" if has_canary and number == 0 else f"wave {number}"
            rows.append(
                {"target": target.name, "wave": label, "host": f"{target.host}:{target.port}", "root": target.root}
            )
    return rows


async def rollout(inventory: Inventory, releases: Releases, log: Callable[[str], None] = print) -> list[TargetResult]:
    """Deploy the run's release (each device its class's variant) wave by wave; one result row per target, in
    inventory order."""
    quiet_lost_connections()
    policy = inventory.policy
    limit = asyncio.Semaphore(policy.max_parallel)
    rows: dict[str, TargetResult] = {}
    plan = waves(inventory)
    canary = bool(policy.canary) and len(plan) > 0

    async def one(target: SshTarget) -> TargetResult:
        async with limit:
            return await remote.deploy(Device(target, policy.timeout_s), releases, policy, log)

    stop = ""
    for number, wave in enumerate(plan):
        if stop:
            for target in wave:
                rows[target.name] = replace(remote.new_result(target), reason=stop)
            continue
        for row in await asyncio.gather(*(one(t) for t in wave)):
            rows[row.target] = row
        bad = [r for r in rows.values() if r.failed]
        if canary and number == 0 and bad:
            stop = f"not tried: the canary failed ({', '.join(r.target for r in bad)})"
        elif 100 * len(bad) / len(inventory.targets) > policy.max_failure_pct:
            stop = f"not tried: {len(bad)} of {len(inventory.targets)} targets failed (> {policy.max_failure_pct:g}%)"
        if stop:
            log(f"[deploy] stopping the rollout: {stop.removeprefix('not tried: ')}")
    return [rows[t.name] for t in inventory.targets]
