"""The one Prefect task every flow runs a stage through, with retries where a retry can cure a failure."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.tasks import Task

from flows.progress import training_progress
from pipeline.errors import TransientError
from pipeline.manifest import RunDir
from pipeline.stages import run_one


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


def submit(stage: str, run: RunDir) -> dict[str, Any]:
    """Run `stage` on `run` as a task, with the stage's retry policy; its StageResult as a dict."""
    return stage_task.with_options(**RETRIES.get(stage, {}))(stage, str(run.path))
