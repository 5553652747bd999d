"""The deploy stage: release the run's model to every configured target and report per target.

Targets are local directories, or, when `deploy.inventory` names an inventory, SSH devices rolled out to in
waves. Not cacheable: the truth is on the targets (someone may have rolled back or wiped one since the last run).
"""

from __future__ import annotations

import asyncio
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Column, Table

from pipeline.config import Config
from pipeline.deploy import remote
from pipeline.deploy.local import ACTIVE, deploy_target
from pipeline.deploy.release import make_plan
from pipeline.deploy.remote import UNREACHABLE
from pipeline.deploy.rollout import failed, rollout, rollout_table, waves
from pipeline.errors import PipelineError, TransientError
from pipeline.files import read_json, write_json
from pipeline.fleet.inventory import load_inventory
from pipeline.layout import DEPLOY_PLAN, DEPLOY_RESULTS, MODEL_JSON, ONNX, PLAN, SAMPLE
from pipeline.manifest import RunDir, Stage, StageResult, run_stage

ACTIVATE_SCRIPT = Path(__file__).with_name("activate.sh")


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Deploy to `cfg.deploy.targets`; writes deploy/results.json, and raises PipelineError if any target failed."""
    return run_stage(run, cfg, STAGE, lambda: _body(cfg, run, log), log, cacheable=False)


def local_engine(run: RunDir) -> tuple[Path, Path] | None:
    """(model.plan, build.json) of the engine the build stage made for this host, None when it made none."""
    engine = recorded_engine(run)
    if engine is None or not str(read_json(engine[1]).get("class", "")).startswith("local"):
        return None
    return engine


def recorded_engine(run: RunDir) -> tuple[Path, Path] | None:
    """(model.plan, build.json) of the engine the build stage recorded (for any device class), None when none."""
    entry = run.manifest()["stages"].get("build")
    if not entry or entry.get("status") not in ("done", "cached"):
        return None
    outputs = entry.get("outputs", {})
    if "engine" not in outputs or "build_info" not in outputs:
        return None
    plan, info = run.path / outputs["engine"], run.path / outputs["build_info"]
    if not plan.is_file():
        raise PipelineError(f"{plan}: the build stage recorded this engine but it is missing (run `pipeline build`)")
    return plan, info


def recorded_engines(run: RunDir) -> dict[str, tuple[Path, Path]]:
    """Device class → (model.plan, build.json) of every engine the build stage recorded (`engine:<class>` outputs,
    or its single `engine` with the class from build.json)."""
    entry = run.manifest()["stages"].get("build")
    if not entry or entry.get("status") not in ("done", "cached"):
        return {}
    outputs = entry.get("outputs", {})
    engines = {
        key.removeprefix("engine:"): (run.path / path, run.path / outputs.get(f"build_info:{key[7:]}", ""))
        for key, path in outputs.items()
        if key.startswith("engine:")
    }
    if not engines and (single := recorded_engine(run)) is not None:
        engines[str(read_json(single[1]).get("class", "unknown"))] = single
    for plan, info in engines.values():
        if not plan.is_file() or not info.is_file():
            raise PipelineError(
                f"{plan}: the build stage recorded this engine but it is missing (run `pipeline build`)"
            )
    return engines


def fleet_releases(run: RunDir) -> remote.Releases:
    """The release for SSH devices: the run's files, the engine for each class, and the activation script."""
    return remote.Releases(run, recorded_engines(run), {remote.ACTIVATE: ACTIVATE_SCRIPT})


def _body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    if cfg.deploy.inventory is not None:
        return _fleet_body(cfg, run, log)
    plan = make_plan(run, local_engine(run))
    engine_note = "with engine" if PLAN in plan.files else "ONNX only"
    log(f"[deploy] release {plan.release_id} ({plan.bytes / 1e6:.2f} MB, {engine_note})")
    results = [deploy_target(target, plan, cfg.deploy, log) for target in cfg.deploy.targets]
    write_json(run.path / DEPLOY_RESULTS, {"release": plan.release_id, "targets": results})
    log(results_table(results))
    failed = [r for r in results if r["status"] != ACTIVE]
    if failed:
        detail = "; ".join(f"{r['target']} ({r['status']}: {r['reason']})" for r in failed)
        raise PipelineError(f"deploy: {len(failed)} of {len(results)} targets failed: {detail}")
    return StageResult(
        "deploy",
        "done",
        outputs=dict(STAGE.outputs),
        metrics={
            "release": plan.release_id,
            "active": len(results),
            "targets": len(results),
            "bytes_copied": sum(r["bytes_copied"] for r in results),
        },
    )


def _fleet_body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    assert cfg.deploy.inventory is not None
    inventory = load_inventory(cfg.deploy.inventory)
    releases = fleet_releases(run)
    classes = [k for k, r in releases.variants.items() if r.engine_class]
    engine_note = f"engines for {', '.join(classes)}" if classes else "ONNX only"
    size = f"{releases.bytes / 1e6:.2f} MB"
    log(f"[deploy] release {releases.id} ({size}, {engine_note}) to {len(inventory.targets)} device(s)")
    plan = {**releases.summary(), "waves": [[t.name for t in wave] for wave in waves(inventory)]}
    write_json(run.path / DEPLOY_PLAN, plan)
    rows = asyncio.run(rollout(inventory, releases, log))
    write_json(run.path / DEPLOY_RESULTS, {"release": releases.id, "inventory": str(inventory.path), "targets": rows})
    log(rollout_table(rows))
    bad = [r for r in rows if r["status"] != ACTIVE]
    if bad:
        detail = "; ".join(f"{r['target']} ({r['status']}: {r['reason']})" for r in bad if failed(r))
        skipped = sum(1 for r in bad if not failed(r))
        more = f"; {skipped} skipped" if skipped else ""
        message = f"deploy: {len(bad)} of {len(rows)} targets not active: {detail or 'none failed'}{more}"
        # Only unreachable devices may come back on a retry; a refusal or a failed check will fail the same way.
        transient = all(r["status"] == UNREACHABLE for r in bad if failed(r)) and any(failed(r) for r in bad)
        raise (TransientError if transient else PipelineError)(message)
    metrics = {"release": releases.id, "active": len(rows), "targets": len(rows)}
    metrics["bytes_sent"] = sum(r["bytes_sent"] for r in rows)
    return StageResult("deploy", "done", outputs=dict(STAGE.outputs), metrics=metrics)


def results_table(results: list[dict[str, Any]]) -> str:
    """The per-target outcome as a small rich table, rendered to text so any `log` callable can show it."""
    columns = [Column(name, no_wrap=True) for name in ("status", "release", "copied", "health")]
    table = Table(Column("target", overflow="fold"), *columns, box=box.SIMPLE_HEAD)
    for r in results:
        table.add_row(r["target"], r["status"], r["release"], f"{r['bytes_copied'] / 1e6:.2f} MB", _verdict(r))
    buffer = io.StringIO()
    # Rendered at the terminal's width: a wider text would be wrapped again by whoever prints it.
    Console(file=buffer, width=shutil.get_terminal_size((80, 24)).columns, color_system=None).print(table)
    return buffer.getvalue().rstrip()


def _verdict(result: dict[str, Any]) -> str:
    health = result["health"]
    if not health:
        return "-"
    return "passed" if health["passed"] else "FAILED"


STAGE = Stage(
    name="deploy",
    sections=("deploy",),
    inputs=(ONNX, SAMPLE, MODEL_JSON),
    outputs={"results": DEPLOY_RESULTS, "plan": DEPLOY_PLAN},
    run=run,
)
