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

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.tasks import submit
from pipeline import report
from pipeline.manifest import RunDir, StageResult
from pipeline.stages import open_run, run_pipeline


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
    A model not clearly above chance fails the flow run (`BelowFloor`), after the report says why.

    `overrides` are `section.key=value` strings, as `--set` takes on the command line.
    """
    cfg, run = open_run(Path(config), Path(run_dir) if run_dir else None, overrides)
    logger = get_run_logger()
    logger.info("run directory: %s", run.path)

    def execute(stage: str) -> StageResult:
        return StageResult(**submit(stage, run))

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
