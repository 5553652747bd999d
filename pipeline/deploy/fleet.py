"""What the CLI asks of all targets at once: what each one runs (`status`) and switching back (`rollback`)."""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, LocalTarget
from pipeline.deploy import switch
from pipeline.deploy.local import check_health, target_root
from pipeline.deploy.release import list_releases, verify_dir
from pipeline.errors import PipelineError


def status(cfg: Config) -> list[dict[str, Any]]:
    """One row per target: current and previous release, how many are kept, whether current verifies."""
    rows = []
    for target in cfg.deploy.targets:
        root = target_root(target)
        row: dict[str, Any] = {"target": target.name, "root": str(root)}
        try:
            links = switch.links(root)
        except PipelineError as err:
            rows.append({**row, "current": "?", "previous": "?", "releases": "?", "verified": str(err)})
            continue
        problem = verify_dir(root / switch.CURRENT) if links.current else "no current release"
        row |= {"current": links.current or "-", "previous": links.previous or "-"}
        rows.append({**row, "releases": len(list_releases(root)), "verified": problem or "yes"})
    return rows


def rollback(cfg: Config, target_name: str | None) -> list[dict[str, Any]]:
    """Swap `current` and `previous` on one target (or all); every target is checked before any is switched."""
    targets = _select(cfg, target_name)
    for target in targets:
        _check_rollback(target)
    rows = []
    for target in targets:
        root = target_root(target)
        links = switch.swap(root)
        verdict = check_health(root, cfg.deploy)
        rows.append(
            {
                "target": target.name,
                "status": "ROLLED_BACK",
                "current": links.current,
                "previous": links.previous,
                "health": "passed" if verdict["passed"] else f"failed: {verdict['reason']}",
            }
        )
    return rows


def _select(cfg: Config, target_name: str | None) -> list[LocalTarget]:
    if target_name is None:
        return list(cfg.deploy.targets)
    chosen = [t for t in cfg.deploy.targets if t.name == target_name]
    if not chosen:
        known = ", ".join(t.name for t in cfg.deploy.targets) or "none"
        raise PipelineError(f"deploy.targets: no target named {target_name!r} (known: {known})")
    return chosen


def _check_rollback(target: LocalTarget) -> None:
    root = target_root(target)
    links = switch.links(root)
    if links.current is None or links.previous is None:
        raise PipelineError(f"{target.name}: nothing to roll back to ({root} has no current and previous release)")
    problem = verify_dir(root / "releases" / links.previous)
    if problem is not None:
        raise PipelineError(f"{target.name}: previous release {links.previous} fails verification: {problem}")
