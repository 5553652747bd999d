"""The ordered stage table and what every entry point shares: resolving a run's config and running stages.

The CLI and the Prefect flow both go through here, so `pipeline run` and the flow do exactly the same work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from pipeline.config import DEFAULT_CONFIG, Config, apply_overrides, load_config, validate
from pipeline.errors import PipelineError
from pipeline.manifest import CONFIG_SNAPSHOT, RunDir, StageResult, create_run_dir, read_json

# Stage name → module exposing `run(cfg, run, log) -> StageResult`. Imported lazily: `pipeline runs list` should
# not pay for importing torch.
STAGE_MODULES: dict[str, str] = {
    "train": "pipeline.train",
    "consolidate": "pipeline.consolidate",
    "export": "pipeline.export",
    "build": "pipeline.build",
    "deploy": "pipeline.deploy",
}
STAGES = tuple(STAGE_MODULES)


def open_run(config: Path | None, run_dir: Path | None, overrides: list[str] | None = None) -> tuple[Config, RunDir]:
    """Resolve the config for a command and make sure its run directory exists.

    With `--config`, that file (plus overrides) is used and snapshotted into the run dir. Without it, an existing
    run dir's snapshot is reused (plus overrides), so `pipeline export --run-dir D` sees what training saw;
    a new run falls back to the embedded quickstart config. The config is validated before anything is written.
    """
    overrides = overrides or []
    snapshot = run_dir / CONFIG_SNAPSHOT if run_dir else None
    if config is None and snapshot is not None and snapshot.exists():
        cfg = validate(apply_overrides(read_json(snapshot), overrides), str(snapshot))
        if not overrides:
            return cfg, RunDir(run_dir)  # type: ignore[arg-type]
    else:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise PipelineError(f"--run-dir {run_dir}: exists and is not a directory")
    return cfg, create_run_dir(cfg, run_dir)


def existing_run(run_dir: Path) -> RunDir:
    """A run directory that must already hold a config snapshot (for stages after train)."""
    if not (run_dir / CONFIG_SNAPSHOT).exists():
        raise PipelineError(f"--run-dir {run_dir}: no {CONFIG_SNAPSHOT}; run `pipeline train` first or pass --config")
    return RunDir(run_dir)


def run_one(stage: str, cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Run a single stage by name."""
    if stage not in STAGE_MODULES:
        raise PipelineError(f"unknown stage {stage!r} (known: {', '.join(STAGES)})")
    module = importlib.import_module(STAGE_MODULES[stage])
    return module.run(cfg, run, log=log)


def run_all(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> list[StageResult]:
    """Run every stage in order; a stage that fails stops the chain with its error."""
    return [run_one(stage, cfg, run, log) for stage in STAGES]
