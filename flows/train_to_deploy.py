"""The `train-to-deploy` flow: every pipeline stage as a Prefect task, in order, on one run directory.

Tasks pass the run directory (a path), never tensors: each stage reads its inputs from disk and records them in the
run's manifest, and the pipeline's own content-hash cache decides what to skip. Prefect's input caching is off
because it would key on the path string, not on what the files hold. The retraining rules (nothing new, champion
vs challenger) are the same ones `pipeline run` applies: `pipeline.stages.run_pipeline`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.tasks import Task

from flows.progress import training_progress
from pipeline import report
from pipeline.errors import TransientError
from pipeline.manifest import RunDir, StageResult
from pipeline.stages import open_run, run_one, run_pipeline


def transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry only failures a retry can cure (unreachable hosts, dropped links), never a failed gate or bad input."""
    return isinstance(state.result(raise_on_failure=False), TransientError)


# Stages talking to devices or remote builders may meet a flaky link; training and export are deterministic.
RETRIES: dict[str, dict[str, Any]] = {
    stage: {"retries": 2, "retry_delay_seconds": 30, "retry_condition_fn": transient} for stage in ("build", "deploy")
}


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, run_dir: str) -> dict[str, Any]:
    """Run one pipeline stage on the run directory with the config snapshotted there."""
    run = RunDir(Path(run_dir))
    cfg = run.load_config()
    logger = get_run_logger()
    # torchrun's output goes into the run's logs, not just the worker's terminal.
    options = {"output": logger.info} if stage == "train" else {}
    with training_progress(run, cfg.train.epochs, enabled=stage == "train"):
        result = run_one(stage, cfg, run, log=logger.info, **options)
    return asdict(result)


def publish(run: RunDir) -> None:
    """The run's report, per-epoch metrics and deploy results as Prefect artifacts.

    report.md on disk links its curves by path; the artifact inlines them, since the UI cannot read the worker's disk.
    """
    report.write(run)
    text = report.markdown(run, embed_images=True)
    create_markdown_artifact(text, key="train-to-deploy-report", description=f"run {run.path.name}")
    if epochs := report.epoch_rows(run):
        create_table_artifact(epochs, key="train-metrics", description=f"per-epoch metrics, run {run.path.name}")
    if targets := report.deploy_rows(run):
        create_table_artifact(targets, key="deploy-results", description=f"per-target deploy, run {run.path.name}")


@flow(name="train-to-deploy", log_prints=True)
def train_to_deploy(
    config: str = "configs/quickstart.toml",
    run_dir: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Train, consolidate, export, build and deploy; returns each stage's result and why the run stopped, if early.

    `overrides` are `section.key=value` strings, as `--set` takes on the command line.
    """
    cfg, run = open_run(Path(config), Path(run_dir) if run_dir else None, overrides)
    logger = get_run_logger()
    logger.info("run directory: %s", run.path)

    def execute(stage: str) -> StageResult:
        return StageResult(**stage_task.with_options(**RETRIES.get(stage, {}))(stage, str(run.path)))

    try:
        outcome = run_pipeline(cfg, run, log=logger.info, execute=execute)
    finally:
        publish(run)
    return {"stopped": outcome.stopped, "stages": {name: asdict(r) for name, r in outcome.results.items()}}


def main() -> None:
    """`python -m flows.train_to_deploy --config FILE [--run-dir DIR] [--set k=v ...]`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default="configs/quickstart.toml")
    parser.add_argument("--run-dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    train_to_deploy(config=args.config, run_dir=args.run_dir, overrides=args.overrides)


if __name__ == "__main__":
    main()
