"""The deploy stage: release the run's model to every configured target and report per target.

Not cacheable: the truth is on the targets (someone may have rolled back or wiped one since the last run).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Column, Table

from pipeline.config import Config
from pipeline.deploy.local import ACTIVE, deploy_target
from pipeline.deploy.release import make_plan
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir, StageResult, read_json, run_stage, write_json

INPUTS = ["onnx/model.onnx", "onnx/sample.npz", "model/model.json"]
RESULTS = "deploy/results.json"
PLAN = "deploy/plan.json"


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Deploy to `cfg.deploy.targets`; writes deploy/results.json, and raises PipelineError if any target failed."""
    return run_stage(run, cfg, "deploy", ("deploy",), INPUTS, lambda: _body(cfg, run, log), log, cacheable=False)


def local_engine(run: RunDir) -> tuple[Path, Path] | None:
    """(model.plan, build.json) of the engine the build stage made for this host, None when it made none."""
    entry = run.manifest()["stages"].get("build")
    if not entry or entry.get("status") not in ("done", "cached"):
        return None
    outputs = entry.get("outputs", {})
    if "engine" not in outputs or "build_info" not in outputs:
        return None
    plan, info = run.path / outputs["engine"], run.path / outputs["build_info"]
    if not plan.is_file():
        raise PipelineError(f"{plan}: the build stage recorded this engine but it is missing (run `pipeline build`)")
    if not str(read_json(info).get("class", "")).startswith("local"):
        return None
    return plan, info


def _body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    plan = make_plan(run, local_engine(run))
    engine_note = "with engine" if "model.plan" in plan.files else "ONNX only"
    log(f"[deploy] release {plan.release_id} ({plan.bytes / 1e6:.2f} MB, {engine_note})")
    results = [deploy_target(target, plan, cfg.deploy, log) for target in cfg.deploy.targets]
    write_json(run.path / RESULTS, {"release": plan.release_id, "targets": results})
    log(results_table(results))
    failed = [r for r in results if r["status"] != ACTIVE]
    if failed:
        detail = "; ".join(f"{r['target']} ({r['status']}: {r['reason']})" for r in failed)
        raise PipelineError(f"deploy: {len(failed)} of {len(results)} targets failed: {detail}")
    return StageResult(
        "deploy",
        "done",
        outputs={"results": RESULTS, "plan": PLAN},
        metrics={
            "release": plan.release_id,
            "active": len(results),
            "targets": len(results),
            "bytes_copied": sum(r["bytes_copied"] for r in results),
        },
    )


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
