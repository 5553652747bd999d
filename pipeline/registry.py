"""The registry of past runs: their manifests under `run.runs_root`, read back for retraining decisions.

Two questions are answered here, for scheduled retraining: has anything changed since the last trained model
(data fingerprint and training config), and is a new model at least as good as the one deployed (the champion)?
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.layout import MANIFEST
from pipeline.manifest import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    """One past run as the registry sees it."""

    path: Path
    """The run directory."""
    manifest: dict[str, Any]
    """Its manifest.json."""

    @property
    def run_id(self) -> str:
        """Directory name: sortable by creation time."""
        return self.path.name

    def stage(self, name: str) -> dict[str, Any]:
        """The manifest entry of a stage ({} when it never ran)."""
        return self.manifest.get("stages", {}).get(name, {})

    @property
    def val_accuracy(self) -> float | None:
        """Validation accuracy the train stage reported."""
        return self.stage("train").get("metrics", {}).get("val_accuracy")

    @property
    def release(self) -> str | None:
        """The release id its deploy stage shipped, if it deployed."""
        return self.stage("deploy").get("metrics", {}).get("release")

    @property
    def deployed(self) -> bool:
        """True when the deploy stage finished with every target active and no rollback has taken it off since."""
        return self.stage("deploy").get("status") == "done" and not self.manifest.get("rolled_back")


def record_rollback(root: Path, rows: list[dict[str, Any]]) -> None:
    """Tell the registry what a rollback did: the run whose release was switched away from is no longer deployed
    (so it stops being the champion), and the run of the release restored counts as deployed again."""
    for row in rows:
        if row.get("status") != "ROLLED_BACK":
            continue
        for record in list_runs(root):
            if record.release == row.get("previous"):  # the release that was current before the rollback
                RunDir(record.path).annotate("rolled_back", value={"target": row["target"], "to": row["current"]})
            elif record.release == row.get("current") and record.manifest.get("rolled_back"):
                RunDir(record.path).annotate("rolled_back", value=None)


def list_runs(root: Path) -> list[RunRecord]:
    """Every run under `root`, newest first. A manifest that cannot be read, or is not shaped as the pipeline writes
    it, is skipped with a warning: one bad run directory must not stop listing, gating or retraining the others."""
    records = []
    for manifest_path in sorted(root.glob(f"*/{MANIFEST}"), reverse=True):
        try:
            manifest = RunDir(manifest_path.parent).manifest()
        except PipelineError as err:
            log.warning("skipping run %s: %s", manifest_path.parent.name, err)
            continue
        if problem := _malformed(manifest):
            log.warning("skipping run %s: %s %s", manifest_path.parent.name, manifest_path, problem)
            continue
        records.append(RunRecord(manifest_path.parent, manifest))
    return records


def _malformed(manifest: Any) -> str:
    """What makes a manifest unusable for the registry ("" when nothing): the fields its questions read."""
    if not isinstance(manifest, dict):
        return f"is not a JSON object but a {type(manifest).__name__}"
    stages = manifest.get("stages", {})
    if not isinstance(stages, dict) or not all(isinstance(entry, dict) for entry in stages.values()):
        return "has no table of stages"
    metrics = stages.get("train", {}).get("metrics", {})
    accuracy = metrics.get("val_accuracy") if isinstance(metrics, dict) else "?"
    if accuracy is not None and (isinstance(accuracy, bool) or not isinstance(accuracy, int | float)):
        return f"holds val_accuracy {accuracy!r}, not a number"
    return ""


def champion(root: Path, exclude: Path | None = None) -> RunRecord | None:
    """The newest run that was deployed everywhere: the model the fleet runs now."""
    skip = exclude.resolve() if exclude else None  # runs_root may be relative: compare where paths really lead
    return next((r for r in list_runs(root) if r.deployed and r.path.resolve() != skip), None)


def trained_with(root: Path, train_digest: str, fingerprints: dict[str, str]) -> RunRecord | None:
    """The newest run whose training saw exactly this config and these inputs (data, initial weights), if any."""
    for record in list_runs(root):
        train = record.stage("train")
        if train.get("status") not in ("done", "cached"):
            continue
        if train.get("config_digest") == train_digest and train.get("inputs") == fingerprints:
            return record
    return None


@dataclass(frozen=True)
class GateResult:
    """Outcome of the champion/challenger gate, with the numbers behind it."""

    passed: bool
    challenger: float
    champion: float | None
    champion_run: str | None
    tolerance: float
    evidence: str = "recorded val_accuracy of each run"
    """What the two numbers are: both models scored on the same held-out images, or each run's own record."""

    @property
    def reason(self) -> str:
        """One sentence a person can read in the report."""
        if self.champion is None:
            return f"no deployed model yet: challenger {self.challenger:.4f} is promoted"
        verdict = "promoted" if self.passed else "not promoted"
        return (
            f"challenger {self.challenger:.4f} vs champion {self.champion:.4f} ({self.champion_run}) "
            f"with tolerance {self.tolerance:.4f}, {self.evidence}: {verdict}"
        )


def promotion_gate(
    challenger: float,
    root: Path,
    tolerance: float,
    exclude: Path | None = None,
    holdout: Callable[[Path], float] | None = None,
) -> GateResult:
    """Promote when the challenger's accuracy is at least the champion's minus `tolerance`.

    `challenger` is the challenger's recorded accuracy and `exclude` its run directory. With `holdout` (run
    directory → accuracy on one fixed set of held-out images), both runs are scored by it, so the numbers compare
    like with like; where a run cannot be scored that way (its exported model is gone), the recorded numbers are
    compared, and the gate says so.
    """
    best = champion(root, exclude=exclude)
    if best is None or best.val_accuracy is None:
        return GateResult(True, challenger, None, None, tolerance)
    ours, theirs, evidence = challenger, best.val_accuracy, "recorded val_accuracy of each run"
    if holdout is not None and exclude is not None:
        try:
            ours, theirs = holdout(exclude), holdout(best.path)
            evidence = "both exported models on the same held-out images"
        except PipelineError as err:
            evidence = f"recorded val_accuracy of each run (not scored on held-out images: {err})"
    return GateResult(ours >= theirs - tolerance, ours, theirs, best.run_id, tolerance, evidence)
