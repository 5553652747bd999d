"""Real photographs, trained for real (slow): from scratch to well above chance with eval mode matching the
weights, and fine-tuning from an earlier run's weights with another class count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline import consolidate, data, layout, train
from pipeline.config import Config, load_config
from pipeline.files import read_json
from pipeline.manifest import RunDir, create_run_dir
from pipeline.stages import chance_floor
from tests import photos

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not photos.available(), reason=f"needs Debian's {photos.PHOTO_PACKAGE} (make test installs it)"),
]

README = ["data.source=imagefolder", "data.image_size=96", "train.batch_size=32"]
"""The README's "Your own images" settings; everything else at its default."""


def photo_config(root: Path, *more: str) -> Config:
    return load_config(None, [*README, f"data.path={root}", *more])


def trained(cfg: Config, run_dir: Path) -> tuple[RunDir, dict[str, Any]]:
    run = create_run_dir(cfg, run_dir)
    train.run(cfg, run, log=lambda _: None)
    return run, read_json(run.path / layout.SUMMARY)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos.build(tmp_path_factory.mktemp("photos") / "photos")


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "resnet18"])
def test_from_scratch_well_above_chance_and_eval_mode_matches_the_weights(
    folder: Path, tmp_path: Path, name: str
) -> None:
    _, summary = trained(photo_config(folder, f"model.name={name}", "train.epochs=30"), tmp_path / "run")
    assert summary["val_accuracy"] >= chance_floor(len(photos.CLASSES)) + 0.1
    assert abs(summary["eval_mode_accuracy"] - summary["train_mode_accuracy"]) <= 0.1
    assert summary["warnings"] == []


def regrouped(folder: Path, root: Path) -> Path:
    """The 5-class folder's training images (never its validation ones) as two classes: animals and plants."""
    coarse = {"birds": "animals", "mammals": "animals", "flowers": "plants", "fruit": "plants", "vegetables": "plants"}
    splits = data.load(photo_config(folder).data, 0)
    for path, _ in splits.train.items:  # type: ignore[attr-defined]
        dest = root / coarse[path.parent.name] / f"{path.parent.name}-{path.name}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(path)
    return root


def val_curve(run: RunDir) -> list[float]:
    """Validation accuracy after each epoch, from train/metrics.jsonl."""
    rows = [json.loads(line) for line in (run.path / layout.METRICS).read_text().splitlines()]
    return [row["val_accuracy"] for row in rows if "val_accuracy" in row]


def test_fine_tuning_an_earlier_runs_weights_replaces_the_head_and_leads_early(folder: Path, tmp_path: Path) -> None:
    model = "model.name=mobilenet_v3_small"
    earlier, _ = trained(photo_config(regrouped(folder, tmp_path / "two"), model, "train.epochs=30"), tmp_path / "a")
    consolidate.run(earlier.load_config(), earlier, log=lambda _: None)
    weights = earlier.path / layout.WEIGHTS
    # The earlier run's own normalisation and a lower rate: what the README measured (ImageNet's and 1e-2 lose).
    tuning = ["train.epochs=10", f"model.weights={weights}", "data.normalize=dataset", "train.lr=1e-3"]
    tuned, summary = trained(photo_config(folder, model, *tuning), tmp_path / "b")
    scratch, _ = trained(photo_config(folder, model, "train.epochs=10"), tmp_path / "c")
    assert sorted(summary["weights_dropped"]) == ["classifier.3.bias [2]", "classifier.3.weight [2, 1024]"]
    assert sum(val_curve(tuned)[:4]) > sum(val_curve(scratch)[:4])  # ahead early; not at the end (README)
