"""The `train-to-deploy` flow: every pipeline stage as a Prefect task, in order, on one run directory.

Tasks pass the run directory (a path), never tensors: each stage reads its inputs from disk and records them in the
run's manifest, and the pipeline's own content-hash cache decides what to skip. Prefect's input caching is off
because it would key on the path string, not on what the files hold.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from pipeline import report
from pipeline.manifest import RunDir
from pipeline.stages import STAGES, open_run, run_one


@task(task_run_name="{stage}", cache_policy=NO_CACHE)
def stage_task(stage: str, run_dir: str) -> dict[str, Any]:
    """Run one pipeline stage on the run directory with the config snapshotted there."""
    run = RunDir(Path(run_dir))
    result = run_one(stage, run.load_config(), run, log=get_run_logger().info)
    return asdict(result)


@flow(name="train-to-deploy", log_prints=True)
def train_to_deploy(
    config: str = "configs/quickstart.toml",
    run_dir: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Train, consolidate, export, build and deploy; returns each stage's result by name.

    `overrides` are `section.key=value` strings, as `--set` takes on the command line.
    """
    _, run = open_run(Path(config), Path(run_dir) if run_dir else None, overrides)
    get_run_logger().info("run directory: %s", run.path)
    results = {stage: stage_task(stage, str(run.path)) for stage in STAGES}
    create_markdown_artifact(report.write(run), key="train-to-deploy-report", description=f"run {run.path.name}")
    return results


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
