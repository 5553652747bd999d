"""Deploying to one local target (a directory standing in for a device), as small steps a transport can reuse.

The plan per target: install the release (stage, verify, rename) → switch `current` → health check → on failure
restore the links and drop the bad release → prune old releases. Only the transport (copy vs. SFTP) and where
the steps run differ for a remote device.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config import DeployConfig, LocalTarget
from pipeline.deploy import health, switch
from pipeline.deploy.release import ReleasePlan, install_release, list_releases
from pipeline.errors import PipelineError

ACTIVE, ROLLED_BACK, FAILED = "ACTIVE", "ROLLED_BACK", "FAILED"


def target_root(target: LocalTarget) -> Path:
    """The target's deploy root as an absolute path (relative roots are relative to the working directory)."""
    return target.root.absolute()


def check_health(root: Path, cfg: DeployConfig) -> dict[str, Any]:
    """Health of whatever `root/current` points at."""
    return health.check(root / switch.CURRENT, cfg.health_atol, cfg.health_atol_fp16)


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the `keep` newest releases, never those `current` or `previous` point at; returns the ids."""
    links = switch.links(root)
    protected = {links.current, links.previous}
    stale = [r for r in list_releases(root)[keep:] if r not in protected]
    for release in stale:
        shutil.rmtree(root / "releases" / release)
    return stale


def deploy_target(
    target: LocalTarget, plan: ReleasePlan, cfg: DeployConfig, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Release `plan` to one target. Never raises for target-side problems: they become status FAILED.

    `previous` in the result is the release that was current before this deploy.
    """
    root = target_root(target)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "target": target.name,
        "root": str(root),
        "status": FAILED,
        "release": plan.release_id,
        "previous": None,
        "bytes_copied": 0,
        "seconds": 0.0,
        "health": {},
        "reason": "",
    }
    try:
        _deploy(root, plan, cfg, result, log)
    except (PipelineError, OSError) as err:
        result["reason"] = str(err)
    result["seconds"] = round(time.perf_counter() - started, 3)
    why = f": {result['reason']}" if result["reason"] else ""
    log(f"[deploy] {target.name}: {result['status']} {plan.release_id} ({result['bytes_copied']} bytes copied){why}")
    return result


def _deploy(
    root: Path, plan: ReleasePlan, cfg: DeployConfig, result: dict[str, Any], log: Callable[[str], None]
) -> None:
    name = result["target"]
    root.mkdir(parents=True, exist_ok=True)
    result["bytes_copied"] = install_release(root, plan)
    before = switch.activate(root, plan.release_id)
    result["previous"] = before.current
    result["health"] = check_health(root, cfg)
    if result["health"]["passed"]:
        result["status"] = ACTIVE
    elif before.current == plan.release_id:
        result["reason"] = f"health check failed on the release already active: {result['health']['reason']}"
    else:
        switch.restore(root, before)
        shutil.rmtree(root / "releases" / plan.release_id, ignore_errors=True)
        back = f"back to {before.current}" if before.current else "no release active"
        result["status"] = ROLLED_BACK
        result["reason"] = f"health check failed ({result['health']['reason']}); {back}"
    removed = prune(root, cfg.keep_releases)
    if removed:
        log(f"[deploy] {name}: pruned {', '.join(removed)}")
