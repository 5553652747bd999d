"""The `pipeline-stage` flow: one stage on an existing run directory, for per-stage deployments.

`prefect deployment run 'pipeline-stage/export' -p run_dir=artifacts/runs/<id>` does what
`pipeline export --run-dir artifacts/runs/<id>` does, with Prefect's logs and history, and the
same retries as the whole chain (build and deploy, on TransientError only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.tasks import submit
from pipeline.stages import STAGES, existing_run, open_run


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
    _, run = open_run(Path(config) if config else None, path, overrides)  # snapshots what --set changed
    return submit(stage, run)
