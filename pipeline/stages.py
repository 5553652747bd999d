"""The ordered stage table and what every entry point shares: resolving a run's config and running stages.

The CLI and the Prefect flow both go through here, so `pipeline run` and the flow do exactly the same work.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline import registry
from pipeline.config import DEFAULT_CONFIG, Config, apply_overrides, load_config, validate
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.layout import CONFIG_SNAPSHOT, DATASET
from pipeline.manifest import RunDir, Stage, StageResult, create_run_dir

STAGES = ("train", "consolidate", "export", "build", "deploy")
"""Stage names in pipeline order, for what must not import the stages (`pipeline runs list`, the report)."""
MODULES = dict(zip(STAGES, ("train", "consolidate", "export", "engines", "deploy"), strict=True))
"""The `pipeline` subpackage that holds each stage's record (`STAGE`)."""


def stage_named(name: str) -> Stage:
    """The record of the stage called `name`; a one-line error naming the known stages otherwise. Its module is
    imported here, when the stage is about to run, and no other stage's: listing runs does not pay for importing
    torch, nor training for export's ONNX libraries and deploy's SSH (3.5 s of a `pipeline train` process)."""
    if name not in STAGES:
        raise PipelineError(f"unknown stage {name!r} (known: {', '.join(STAGES)})")
    stage: Stage = importlib.import_module(f"pipeline.{MODULES[name]}").STAGE
    return stage


def open_run(config: Path | None, run_dir: Path | None, overrides: list[str] | None = None) -> tuple[Config, RunDir]:
    """Resolve the config for a command and make sure its run directory exists.

    With `--config`, that file (plus overrides) is used and snapshotted into the run dir. Without it, an existing
    run dir's snapshot is reused (plus overrides), so `pipeline export --run-dir D` sees what training saw;
    a new run falls back to the embedded quickstart config. The config is validated before anything is written.
    """
    overrides = overrides or []
    if config is None and run_dir is not None and (run_dir / CONFIG_SNAPSHOT).exists():
        run = RunDir(run_dir)
        cfg = validate(apply_overrides(run.config_data(), overrides), str(run_dir / CONFIG_SNAPSHOT))
        if not overrides:
            return cfg, run
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


def run_one(stage: str, cfg: Config, run: RunDir, log: Callable[[str], None] = print, **options: Any) -> StageResult:
    """Run a single stage by name; `options` go to that stage's `run` (e.g. train's `output`)."""
    return stage_named(stage).run(cfg, run, log=log, **options)


Execute = Callable[[str], StageResult]


@dataclass
class Outcome:
    """How a whole pipeline run ended."""

    results: dict[str, StageResult] = field(default_factory=dict)
    """Result of every stage that ran (or was cached), by name."""
    stopped: str = ""
    """Why the run ended before deploy without an error (nothing new, not promoted); empty when it ran through."""


def nothing_new(cfg: Config, run: RunDir) -> str:
    """Why training can be skipped ("" when it can't): an earlier run trained on the same data and config."""
    train = stage_named("train")
    same = registry.trained_with(cfg.run.runs_root, cfg.digest(*train.sections), train.external(cfg))
    if same is None or same.path.resolve() == run.path.resolve():
        return ""
    return f"nothing new: data and training config unchanged since run {same.run_id}"


def promote(cfg: Config, run: RunDir) -> registry.GateResult:
    """The champion/challenger gate, both exported models scored on the challenger's held-out images; recorded in
    the manifest under gates.promotion with both numbers and the split's fingerprint."""
    from pipeline.holdout import Holdout  # imported here, as the stages are (stage_named): it imports torch

    challenger = run.manifest()["stages"]["train"]["metrics"]["val_accuracy"]
    holdout = Holdout(cfg.data.for_scoring(), cfg.run.seed, run.path)
    gate = registry.promotion_gate(
        challenger, cfg.run.runs_root, cfg.retrain.promotion_tolerance, exclude=run.path.resolve(), holdout=holdout
    )
    split = {"fingerprint": holdout.fingerprint, "images": holdout.images}
    run.annotate("gates", "promotion", value={**asdict(gate), "reason": gate.reason, "split": split})
    return gate


def chance_floor(classes: int) -> float:
    """The default `retrain.min_accuracy`: twice chance, or a fifth of the way from chance to 1, whichever is
    lower. Clearly above what guessing scores, yet reachable for many classes (100 classes: 0.02)."""
    chance = 1.0 / classes
    return round(min(2 * chance, chance + 0.2 * (1 - chance)), 4)


class BelowFloor(PipelineError):
    """The model is not clearly above chance: the run stopped before build and deploy, and that is a failure.

    Unlike "not better than the champion" (a normal outcome: the deployed model stays), a model at chance means
    the data, the labels or the settings are wrong; a script checking `pipeline run`'s exit status, and the
    Prefect flow run's state, must see it. Exit code 1: the input was valid, the result is not."""

    exit_code = 1


@dataclass(frozen=True)
class FloorResult:
    """Outcome of the accuracy floor: is the model clearly better than guessing?"""

    passed: bool
    accuracy: float
    floor: float
    classes: int
    derived: bool
    """True when the floor is the default derived from the class count, False when `retrain.min_accuracy` set it."""

    @property
    def reason(self) -> str:
        """One sentence a person can read in the report."""
        source = f"derived from {self.classes} classes, chance {1 / self.classes:.4f}" if self.derived else "set"
        verdict = "clears" if self.passed else "is not clearly above chance: below"
        return (
            f"validation accuracy {self.accuracy:.4f} {verdict} the floor {self.floor:.4f} "
            f"(retrain.min_accuracy, {source})"
        )


def accuracy_floor(accuracy: float, classes: int, min_accuracy: float | None) -> FloorResult:
    """Pass when `accuracy` reaches `min_accuracy`, or the floor derived from the class count when it is unset."""
    floor = chance_floor(classes) if min_accuracy is None else min_accuracy
    return FloorResult(accuracy >= floor, accuracy, floor, classes, min_accuracy is None)


def floor(cfg: Config, run: RunDir) -> FloorResult:
    """The accuracy floor on the trained model, recorded in the manifest under gates.floor."""
    accuracy = run.manifest()["stages"]["train"]["metrics"]["val_accuracy"]
    classes = len(read_json(run.path / DATASET)["classes"])
    gate = accuracy_floor(accuracy, classes, cfg.retrain.min_accuracy)
    run.annotate("gates", "floor", value={**asdict(gate), "reason": gate.reason})
    return gate


def run_pipeline(
    cfg: Config, run: RunDir, log: Callable[[str], None] = print, execute: Execute | None = None
) -> Outcome:
    """Run the stages in order, with the retraining rules between them.

    `execute` runs one stage by name (the Prefect flow passes one that submits a task); by default stages run here.
    With `retrain.only_on_new_data`, an unchanged run ends before training. After export, a model worse than the
    deployed champion (beyond `retrain.promotion_tolerance`) ends the run before build and deploy, and one not
    clearly above chance (`retrain.min_accuracy`) too, raising :class:`BelowFloor` once the manifest says why.
    """
    execute = execute or (lambda stage: run_one(stage, cfg, run, log))
    outcome = Outcome()
    if cfg.retrain.only_on_new_data and (reason := nothing_new(cfg, run)):
        outcome.stopped = reason
    for stage in STAGES if not outcome.stopped else ():
        if stage == "build" and not (useful := floor(cfg, run)).passed:
            stopped = f"stopped before build: {useful.reason}"
            run.annotate("stopped", value=stopped)
            raise BelowFloor(stopped)
        if stage == "build" and not (gate := promote(cfg, run)).passed:
            outcome.stopped = f"stopped before build: {gate.reason}"
            break
        outcome.results[stage] = execute(stage)
    if outcome.stopped:
        run.annotate("stopped", value=outcome.stopped)
        log(f"[run] {outcome.stopped}")
    return outcome
