"""The `pipeline-stage` flow: one stage on an existing run directory, for per-stage deployments.

`prefect deployment run 'pipeline-stage/export' -p run_dir=artifacts/runs/<id>` does what
`pipeline export --run-dir artifacts/runs/<id>` does, with Prefect's logs, retries and history.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from pipeline.stages import STAGES, existing_run, open_run, run_one


@flow(name="pipeline-stage", flow_run_name="{stage}")
def pipeline_stage(
    stage: str, run_dir: str, config: str | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Run `stage` (one of train, consolidate, export, build, deploy) on `run_dir`; returns its result."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    path = Path(run_dir)
    if config is None and stage != "train":
        existing_run(path)
    cfg, run = open_run(Path(config) if config else None, path, overrides)
    return asdict(run_one(stage, cfg, run, log=get_run_logger().info))
