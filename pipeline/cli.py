"""`pipeline <stage>`: one subcommand per stage, `run` for all of them, and commands to inspect runs.

Every subcommand maps to one library function; this file only parses arguments and prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pipeline import report
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir
from pipeline.stages import existing_run, open_run, run_one, run_pipeline

app = typer.Typer(
    help="Train-to-deploy pipeline for edge AI.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold keys and hostnames
)
deploy_app = typer.Typer(help="Release models to targets, inspect them, roll back.", no_args_is_help=True)
runs_app = typer.Typer(help="Inspect past runs.", no_args_is_help=True)
app.add_typer(deploy_app, name="deploy")
app.add_typer(runs_app, name="runs")
console = Console()


def log(message: str) -> None:
    """Print a stage's progress line as plain text: `[train] ...` is not rich markup."""
    console.print(message, markup=False, highlight=False)


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config (default: quickstart).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default: new, in run.runs_root).")]
ExistingRunDir = Annotated[Path, typer.Option("--run-dir", help="Run directory made by an earlier stage.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: section.key=value (value read as TOML).")
]


def _stage_config(config: Path | None, run_dir: Path, overrides: list[str] | None) -> tuple[Config, RunDir]:
    """Config for a stage after train: the run's own snapshot unless --config or --set says otherwise."""
    if config is None:
        existing_run(run_dir)
    return open_run(config, run_dir, overrides)


def _show(run: RunDir) -> None:
    table = Table(title=f"run {run.path}")
    for col in ("stage", "status", "seconds", "result"):
        table.add_column(col, justify="right" if col == "seconds" else "left")
    rows = report.stage_rows(run)
    for row in rows:
        seconds = f"{row['seconds']:.1f}" if row["seconds"] is not None else ""
        table.add_row(row["stage"], row["status"], seconds, row["summary"])
    console.print(table)
    # The table shows a reason's first clause; the whole of it goes below, where it has the width it needs.
    for row in rows:
        if row["reason"] and row["summary"] != row["reason"]:
            console.print(f"{row['stage']} {row['status']}: {row['reason']}", markup=False, highlight=False)


@app.command()
def run(config: ConfigOpt = None, run_dir: RunDirOpt = None, set_: SetOpt = None) -> None:
    """Run every stage: train, consolidate, export, build, deploy. Unchanged stages are skipped as cached.

    A model less accurate than the deployed one (beyond retrain.promotion_tolerance) stops before build.
    """
    cfg, rd = open_run(config, run_dir, set_)
    console.print(f"run directory: [bold]{rd.path}[/bold]")
    try:
        run_pipeline(cfg, rd, log=log)
    finally:
        report.write(rd)
        _show(rd)
    console.print(f"report: {rd.path / 'report.md'}")


@app.command()
def train(
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    nproc_per_node: Annotated[int | None, typer.Option(help="Ranks on this node.")] = None,
    nnodes: Annotated[int, typer.Option(help="Nodes taking part (multi-node: start this command on each).")] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of the c10d rendezvous (node 0).")] = None,
    local_addr: Annotated[
        str | None, typer.Option(help="This node's address as the others reach it (default: from its hostname).")
    ] = None,
) -> None:
    """Distributed training with torchrun; writes train/ in the run directory."""
    from pipeline.train import run as train_stage

    cfg, rd = open_run(config, run_dir, set_)
    train_stage(
        cfg,
        rd,
        log=log,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        local_addr=local_addr,
    )


def _stage_command(stage: str, doc: str) -> None:
    def command(run_dir: ExistingRunDir, config: ConfigOpt = None, set_: SetOpt = None) -> None:
        cfg, rd = _stage_config(config, run_dir, set_)
        run_one(stage, cfg, rd, log=log)

    command.__doc__ = doc
    app.command(name=stage)(command)


_stage_command("consolidate", "Merge the latest sharded checkpoint into model/model.safetensors + model.json.")
_stage_command("export", "Export ONNX with a dynamic batch axis and check parity against PyTorch.")


@app.command(name="build")
def build_command(
    run_dir: ExistingRunDir,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    inventory: InventoryOpt = None,
) -> None:
    """Build a TensorRT engine per device class (`build.classes`; with --inventory also one per class the fleet's
    devices report, built on a device of that class), or report the stage as skipped when TensorRT is absent."""
    overrides = _with_inventory(set_, inventory) + (["build.from_inventory=true"] if inventory else [])
    cfg, rd = _stage_config(config, run_dir, overrides)
    run_one("build", cfg, rd, log=log)


InventoryOpt = Annotated[
    Path | None, typer.Option("--inventory", "-i", help="Fleet inventory TOML (SSH devices); sets deploy.inventory.")
]


def _with_inventory(overrides: list[str] | None, inventory: Path | None) -> list[str]:
    """--inventory as one more `--set` (a JSON string is a TOML string), so the run's config records it."""
    return [*(overrides or []), *([f"deploy.inventory={json.dumps(str(inventory.absolute()))}"] if inventory else [])]


def _inventory(config: Path | None, overrides: list[str] | None, inventory: Path | None) -> Path | None:
    from pipeline.config import load_config

    return inventory or load_config(config, overrides).deploy.inventory


@deploy_app.command("run")
def deploy_run(
    run_dir: ExistingRunDir, config: ConfigOpt = None, set_: SetOpt = None, inventory: InventoryOpt = None
) -> None:
    """Release the run's model to every target: upload, verify, switch, health check, roll back on failure."""
    cfg, rd = _stage_config(config, run_dir, _with_inventory(set_, inventory) or None)
    run_one("deploy", cfg, rd, log=log)


@deploy_app.command("plan")
def deploy_plan(inventory: InventoryOpt = None, config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Show the rollout order (canary, waves) without touching any device."""
    from pipeline.deploy.inventory import load_inventory
    from pipeline.deploy.rollout import plan_rows

    path = _inventory(config, set_, inventory)
    if path is None:
        raise PipelineError("deploy plan: needs --inventory (or deploy.inventory in the config)")
    _print_targets(plan_rows(load_inventory(path)))


@deploy_app.command("status")
def deploy_status(inventory: InventoryOpt = None, config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Show what each target runs now (over SSH: model, L4T, JetPack, TensorRT, class, free space, temperature)."""
    from pipeline.config import load_config

    path = _inventory(config, set_, inventory)
    if path is None:
        from pipeline.deploy import status

        _print_targets(status(load_config(config, set_)))
        return
    from pipeline.deploy import ssh_fleet
    from pipeline.deploy.inventory import load_inventory

    rows = ssh_fleet.status(load_inventory(path))
    _print_targets(rows)
    _exit_if(rows, ok=("reachable",))


@deploy_app.command("rollback")
def deploy_rollback(
    inventory: InventoryOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    target: Annotated[str | None, typer.Option(help="Only this target (default: all).")] = None,
) -> None:
    """Switch targets back to their previous release."""
    from pipeline.config import load_config

    path = _inventory(config, set_, inventory)
    if path is None:
        from pipeline.deploy import rollback

        _print_targets(rollback(load_config(config, set_), target))
        return
    from pipeline.deploy import ssh_fleet
    from pipeline.deploy.inventory import load_inventory

    rows = ssh_fleet.rollback(load_inventory(path), target)
    _print_targets(rows)
    _exit_if(rows, ok=("ROLLED_BACK",))


def _exit_if(rows: list[dict], ok: tuple[str, ...]) -> None:
    """Exit 1 when any device's row is not in an `ok` status (the table above says why)."""
    if any(row["status"] not in ok for row in rows):
        raise typer.Exit(1)


def _print_targets(rows: list[dict]) -> None:
    table = Table()
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(col, "")) for col in columns))
    console.print(table)


@runs_app.command("list")
def runs_list(
    root: Annotated[Path, typer.Option(help="Where runs live (run.runs_root).")] = Path("artifacts/runs"),
) -> None:
    """List runs, newest first: validation accuracy, each stage's status, and which run the fleet runs now."""
    from pipeline import registry
    from pipeline.stages import STAGES

    runs = registry.list_runs(root)
    champion = next((r for r in runs if r.deployed), None)
    table = Table()
    for col in ("run", "val acc", *STAGES, "note"):
        table.add_column(col)
    for record in runs:
        statuses = [record.stage(s).get("status", "-") for s in STAGES]
        accuracy = f"{record.val_accuracy:.4f}" if record.val_accuracy is not None else "-"
        note = "deployed (champion)" if record is champion else record.manifest.get("stopped", "")
        table.add_row(record.run_id, accuracy, *statuses, note)
    console.print(table)


@runs_app.command("show")
def runs_show(run_dir: Annotated[Path, typer.Argument(help="Run directory.")]) -> None:
    """Show one run's report."""
    from rich.markdown import Markdown

    if not (run_dir / "manifest.json").exists():
        raise PipelineError(f"{run_dir}: no manifest.json (not a run directory)")
    console.print(Markdown(report.markdown(RunDir(run_dir))))


def main() -> None:
    """Console-script entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
