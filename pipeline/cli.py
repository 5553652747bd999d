"""`pipeline <stage>`: one subcommand per stage, `run` for all of them, and commands to inspect runs.

Every subcommand maps to one library function; this file only parses arguments and prints.

Over the project's ~450 lines on purpose: most of it is the commands' help texts, which are the CLI reference
(docs/reference/cli.md is generated from them), kept beside the options they describe.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pipeline import report
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.library_warnings import show_debug_log
from pipeline.manifest import RunDir
from pipeline.stages import STAGES, existing_run, open_run, run_one, run_pipeline
from pipeline.tables import Col, print_rows

app = typer.Typer(
    help="Train-to-deploy pipeline for edge AI. `python -m pipeline` is the same command.\n\n"
    "Errors you can cause (config, paths, corrupt files) end with one line on stderr and exit code 2; nothing is "
    "overwritten.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals may hold keys and hostnames
)
deploy_app = typer.Typer(help="Release models to targets, inspect them, roll back.", no_args_is_help=True)
runs_app = typer.Typer(help="Inspect past runs.", no_args_is_help=True)
cluster_app = typer.Typer(help="Devices that train together over SSH.", no_args_is_help=True)
app.add_typer(deploy_app, name="deploy")
app.add_typer(cluster_app, name="cluster")
app.add_typer(runs_app, name="runs")
console = Console()
err_console = Console(stderr=True)  # what --json moves off stdout: progress lines, paths


def log(message: str) -> None:
    """Print a stage's progress line as plain text: `[train] ...` is not rich markup."""
    console.print(message, markup=False, highlight=False)


def log_to_stderr(message: str) -> None:
    """`log` for --json, whose stdout holds the JSON and nothing else."""
    err_console.print(message, markup=False, highlight=False)


def _version(value: bool) -> None:
    if value:
        from pipeline.version import describe

        print(describe())
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the version and the commit the package was built from (-dirty: with uncommitted changes), "
            "exit.",
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also print the debug log: warnings from the libraries underneath.")
    ] = False,
) -> None:
    """Options of `pipeline` itself, before any command (its help text is the app's)."""
    if verbose:
        show_debug_log()


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config (default: quickstart).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default: new, in run.runs_root).")]
ExistingRunDir = Annotated[Path, typer.Option("--run-dir", help="Run directory made by an earlier stage.")]
RunConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="TOML config replacing the run's own (default: <run-dir>/config.json)."),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: section.key=value (value read as TOML).")
]
InventoryOpt = Annotated[
    Path | None, typer.Option("--inventory", "-i", help="Fleet inventory TOML (SSH devices); sets deploy.inventory.")
]
WideOpt = Annotated[bool, typer.Option("--wide", "-w", help="Show every column, none shortened.")]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print the rows as a JSON list (every column) and nothing else on stdout; progress lines go to stderr, "
        "the exit code is the same.",
    ),
]


def _stage_config(config: Path | None, run_dir: Path, overrides: list[str] | None) -> tuple[Config, RunDir]:
    """Config for a stage after train: the run's own snapshot unless --config or --set says otherwise."""
    if config is None:
        existing_run(run_dir)
    return open_run(config, run_dir, overrides)


STAGE_COLUMNS = (
    Col("stage"),
    Col("status"),
    Col("seconds", fmt=lambda s: "" if s is None else f"{s:.1f}", justify="right"),
    Col("summary", "result", text=True),
    # The cell holds a skipped stage's first clause; the whole reason goes under the table.
    Col("reason", below=True),
    Col("outputs", wide=True, fmt=lambda outputs: " ".join((outputs or {}).values())),
)


@app.command()
def run(
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every stage: train, consolidate, export, build, deploy. Unchanged stages are skipped as cached.

    A model less accurate than the deployed one (beyond retrain.promotion_tolerance) stops before build (exit 0);
    one not clearly above chance (retrain.min_accuracy) stops there too, with one line and exit 1.
    """
    cfg, rd = open_run(config, run_dir, set_)
    out = err_console if as_json else console
    out.print(f"run directory: [bold]{rd.path}[/bold]")
    try:
        run_pipeline(cfg, rd, log=log_to_stderr if as_json else log)
    except BaseException:
        # Show what ran, but never let a failing report hide the error that stopped the run.
        with contextlib.suppress(PipelineError, OSError):
            _report(rd, wide, as_json)
        raise
    _report(rd, wide, as_json)


def _report(rd: RunDir, wide: bool, as_json: bool) -> None:
    """Write report.md and print the stage table (or its rows as JSON)."""
    report.write(rd)
    print_rows(console, report.stage_rows(rd), STAGE_COLUMNS, wide=wide, as_json=as_json, title=f"run {rd.path}")
    (err_console if as_json else console).print(f"report: {rd.path / 'report.md'}", markup=False, highlight=False)


@app.command()
def train(
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    set_: SetOpt = None,
    nproc_per_node: Annotated[int | None, typer.Option(help="Ranks on this node.")] = None,
    nnodes: Annotated[
        int,
        typer.Option(
            help="torchrun nodes of one job on a shared filesystem (start this command on each); "
            "the SSH cluster's device count is train.devices."
        ),
    ] = 1,
    node_rank: Annotated[int, typer.Option(help="This node's rank, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of the c10d rendezvous (node 0).")] = None,
    local_addr: Annotated[
        str | None, typer.Option(help="This node's address as the others reach it (default: from its hostname).")
    ] = None,
    inventory: Annotated[
        Path | None,
        typer.Option("--inventory", "-i", help="Train on these devices over SSH (sets train.inventory)."),
    ] = None,
) -> None:
    """Distributed training with torchrun; writes train/ in the run directory. With --inventory, on the
    inventory's devices, started from here over SSH.

    Several hosts on a shared filesystem: start the same command on each with --nnodes, --node-rank and
    --rdzv-endpoint; the run directory must be on the shared filesystem, and node 0 records the stage in the
    manifest. --local-addr is needed where the hostname resolves to another interface (WiFi and Ethernet, a
    container).
    """
    from pipeline.train import run as train_stage
    from pipeline.train.launch.topology import Topology

    with_inventory = [f"train.inventory={json.dumps(str(inventory.absolute()))}"] if inventory else []
    cfg, rd = open_run(config, run_dir, [*(set_ or []), *with_inventory] or None)
    topology = Topology(
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        nproc_per_node=nproc_per_node,
        local_addr=local_addr,
    )
    train_stage(cfg, rd, log=log, topology=topology)


def _stage_command(stage: str, doc: str) -> None:
    def command(run_dir: ExistingRunDir, config: RunConfigOpt = None, set_: SetOpt = None) -> None:
        cfg, rd = _stage_config(config, run_dir, set_)
        run_one(stage, cfg, rd, log=log)

    command.__doc__ = doc
    app.command(name=stage)(command)


_stage_command("consolidate", "Merge the latest sharded checkpoint into model/model.safetensors + model.json.")
_stage_command(
    "export",
    "Export ONNX with a dynamic batch axis and check parity against PyTorch (and the accuracy of the fp16 and int8 "
    "variants export.variants names); onnx/ is replaced only when every gate passes.",
)


@app.command(name="build")
def build_command(
    run_dir: ExistingRunDir,
    config: RunConfigOpt = None,
    set_: SetOpt = None,
    inventory: InventoryOpt = None,
) -> None:
    """Build a TensorRT engine per device class (`build.classes`; with --inventory also one per class the fleet's
    devices report, built on a device of that class), or report the stage as skipped when TensorRT is absent."""
    overrides = _with_inventory(set_, inventory) + (["build.from_inventory=true"] if inventory else [])
    cfg, rd = _stage_config(config, run_dir, overrides)
    run_one("build", cfg, rd, log=log)


def _with_inventory(overrides: list[str] | None, inventory: Path | None) -> list[str]:
    """--inventory as one more `--set` (a JSON string is a TOML string), so the run's config records it."""
    return [*(overrides or []), *([f"deploy.inventory={json.dumps(str(inventory.absolute()))}"] if inventory else [])]


def _inventory(config: Path | None, overrides: list[str] | None, inventory: Path | None) -> Path | None:
    from pipeline.config import load_config

    return inventory or load_config(config, overrides).deploy.inventory


@deploy_app.command("run")
def deploy_run(
    run_dir: ExistingRunDir, config: RunConfigOpt = None, set_: SetOpt = None, inventory: InventoryOpt = None
) -> None:
    """Release the run's model to every target: upload, verify, switch, health check, roll back on failure.

    Over SSH (--inventory): the canary first, then waves. Exits 1 when any target did not end ACTIVE; the reasons
    are printed under the table and kept in deploy/results.json.
    """
    cfg, rd = _stage_config(config, run_dir, _with_inventory(set_, inventory) or None)
    run_one("deploy", cfg, rd, log=log)


# Default views: what matters most, fitting 80 columns with realistic names (release ids have 29 characters, device
# classes 19); the rest is in --wide and --json.
PLAN_COLUMNS = (Col("target"), Col("wave"), Col("host"), Col("root"))
SSH_STATUS_COLUMNS = (
    Col("target"),
    Col("status"),
    Col("class"),
    Col("current"),
    Col("temp", optional=True, justify="right"),
    *(Col(key, wide=True) for key in ("previous", "model", "l4t", "jetpack", "tensorrt", "free", "seconds")),
    Col("reason", text=True, below=True),
)
LOCAL_STATUS_COLUMNS = (
    Col("target"),
    Col("current"),
    Col("verified", text=True),
    Col("previous", optional=True),
    Col("releases", wide=True, justify="right"),
    Col("root", wide=True),
)
ROLLBACK_COLUMNS = (
    Col("target"),
    Col("status"),
    Col("current"),
    Col("health", text=True),
    Col("previous", wide=True),
    Col("reason", text=True, below=True),
)


@deploy_app.command("plan")
def deploy_plan(
    inventory: InventoryOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Show the rollout order (canary, waves) without touching any device."""
    from pipeline.deploy.rollout import plan_rows
    from pipeline.fleet.inventory import load_inventory

    path = _inventory(config, set_, inventory)
    if path is None:
        raise PipelineError("deploy plan: needs --inventory (or deploy.inventory in the config)")
    print_rows(console, plan_rows(load_inventory(path)), PLAN_COLUMNS, wide=wide, as_json=as_json)


@deploy_app.command("status")
def deploy_status(
    inventory: InventoryOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Show what each target runs now: its release, and over SSH its device class and temperature (--wide: previous
    release, board, L4T, JetPack, TensorRT, free space). With an inventory, exits 1 when a device is unreachable."""
    from pipeline.config import load_config

    path = _inventory(config, set_, inventory)
    if path is None:
        from pipeline.deploy import status

        print_rows(console, status(load_config(config, set_)), LOCAL_STATUS_COLUMNS, wide=wide, as_json=as_json)
        return
    from pipeline.deploy import ssh_fleet
    from pipeline.fleet.inventory import load_inventory

    rows = ssh_fleet.status(load_inventory(path))
    print_rows(console, rows, SSH_STATUS_COLUMNS, wide=wide, as_json=as_json)
    _exit_if(rows, ok=("reachable",))


@deploy_app.command("rollback")
def deploy_rollback(
    inventory: InventoryOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    target: Annotated[str | None, typer.Option(help="Only this target (default: all).")] = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Switch targets back to their previous release, through that release's own activate.sh (preflight, switch,
    health check); the run they return to becomes the champion again. Exits 1 when a target could not."""
    from pipeline import registry
    from pipeline.config import load_config

    cfg = load_config(config, set_)
    path = _inventory(config, set_, inventory)
    if path is None:
        from pipeline.deploy import rollback

        rows = rollback(cfg, target)
    else:
        from pipeline.deploy import ssh_fleet
        from pipeline.fleet.inventory import load_inventory

        rows = ssh_fleet.rollback(load_inventory(path), target)
    registry.record_rollback(cfg.run.runs_root, rows)
    print_rows(console, rows, ROLLBACK_COLUMNS, wide=wide, as_json=as_json)
    _exit_if(rows, ok=("ROLLED_BACK",))


def _exit_if(rows: list[dict], ok: tuple[str, ...]) -> None:
    """Exit 1 when any device's row is not in an `ok` status (the rows printed say why)."""
    if any(row["status"] not in ok for row in rows):
        raise typer.Exit(1)


CLUSTER_COLUMNS = (
    Col("target"),
    Col("status"),
    Col("python"),
    Col("torch"),
    Col("cuda", optional=True),
    Col("gpu", text=True, optional=True),
    Col("backends"),
    Col("mem_free", "mem free", optional=True, justify="right"),
    Col("disk_free", "disk free", optional=True, justify="right"),
    Col("code"),
    *(Col(key, wide=True) for key in ("power_mode", "gpu_mhz", "cpu0_mhz", "missing", "install", "bytes_sent")),
    Col("reason", text=True, below=True),
)
SELFTEST_COLUMNS = (
    *CLUSTER_COLUMNS[:-1],
    Col("selftest", "self-test"),
    Col("all_reduce_ms", "all-reduce ms", justify="right"),
    Col("train_step_ms", "step ms", justify="right"),
    Col("inference"),
    Col("inference_ms", "inference ms", justify="right"),
    CLUSTER_COLUMNS[-1],
)


@cluster_app.command("check")
def cluster_check(
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Devices (or train.inventory).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    wide: WideOpt = False,
    as_json: JsonOpt = False,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep",
            help="Also run each device's self-test: the job's backend with one peer, one training step of the "
            "config's model, one inference of its installed release; each timed.",
        ),
    ] = False,
) -> None:
    """Check every device for training: Python, torch, CUDA, GPU, the distributed backends, free memory and disk,
    power mode and clocks, missing packages (with the command that installs them) and the code version, which it
    ships to them first. Exits 2, naming the first device that cannot train (or, with --deep, whose self-test
    failed), when any cannot."""
    from pipeline.config import load_config
    from pipeline.fleet.inventory import load_inventory
    from pipeline.train import cluster
    from pipeline.train.cluster import selftest

    cfg = load_config(config, set_) if deep or inventory is None else None  # the self-test trains its model
    path = inventory or (cfg.train.inventory if cfg else None)
    if path is None:
        raise PipelineError("cluster check: needs --inventory (or train.inventory in the config)")
    nodes = cluster.check(load_inventory(path))
    rows = [node.row() for node in nodes]
    if not deep or any(node.status != "ready" for node in nodes):
        print_rows(console, rows, CLUSTER_COLUMNS, wide=wide, as_json=as_json)
        cluster.refuse_unready(nodes)
        return
    assert cfg is not None
    found = {row["target"]: row for row in selftest.deep(cfg, nodes, nodes[0].facts["code_version"])}
    merged = [row | {k: v for k, v in found[row["target"]].items() if k != "status"} for row in rows]
    for row in merged:
        row["selftest"] = found[row["target"]]["status"]
    print_rows(console, merged, SELFTEST_COLUMNS, wide=wide, as_json=as_json)
    selftest.refuse_failed(list(found.values()))


RUN_COLUMNS = (
    Col("run"),
    Col("val_accuracy", "val acc", fmt=lambda acc: "-" if acc is None else f"{acc:.4f}", justify="right"),
    Col("last_stage", "last stage", fmt=lambda last: last or "-"),
    *(Col(stage, wide=True, fmt=lambda status: status or "-") for stage in STAGES),
    Col("path", wide=True),
    Col("note", text=True),
)


@runs_app.command("list")
def runs_list(
    root: Annotated[Path, typer.Option(help="Where runs live (run.runs_root).")] = Path("artifacts/runs"),
    wide: WideOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first: validation accuracy, how far each got (--wide: every stage's status), and which
    run the fleet runs now."""
    from pipeline import registry

    runs = registry.list_runs(root)
    champion = next((r for r in runs if r.deployed), None)
    rows = []
    for record in runs:
        statuses = {stage: record.stage(stage).get("status") for stage in STAGES}
        last = next((stage for stage in reversed(STAGES) if statuses[stage]), None)
        rows.append(
            {
                "run": record.run_id,
                "val_accuracy": record.val_accuracy,
                "last_stage": f"{last} {statuses[last]}" if last else None,
                **statuses,
                "path": str(record.path),
                "note": "deployed (champion)" if record is champion else record.manifest.get("stopped", ""),
            }
        )
    print_rows(console, rows, RUN_COLUMNS, wide=wide, as_json=as_json)


@runs_app.command("show")
def runs_show(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's manifest.json instead.")] = False,
) -> None:
    """Show one run's report."""
    from rich.markdown import Markdown

    if not (run_dir / "manifest.json").exists():
        raise PipelineError(f"{run_dir}: no manifest.json (not a run directory)")
    if as_json:
        print(json.dumps(RunDir(run_dir).manifest(), indent=2))
        return
    console.print(Markdown(report.markdown(RunDir(run_dir))))


def main() -> None:
    """Run the app: user errors become one line on stderr and exit code 2 (entry point: pipeline/__main__.py)."""
    try:
        app()
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
