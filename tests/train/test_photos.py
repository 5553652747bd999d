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

OWN_IMAGES = ["data.source=imagefolder", "data.image_size=96"]
"""The settings of docs/how-to/own-images.md's first command; everything else (batch, epochs, learning rate) at its
default."""
TARGET = chance_floor(len(photos.CLASSES)) + 0.1
"""Well above chance: the default floor (0.36 for 5 classes) plus 0.1."""


def photo_config(root: Path, *more: str) -> Config:
    return load_config(None, [*OWN_IMAGES, f"data.path={root}", *more])


def trained(cfg: Config, run_dir: Path) -> tuple[RunDir, dict[str, Any]]:
    run = create_run_dir(cfg, run_dir)
    train.run(cfg, run, log=lambda _: None)
    return run, read_json(run.path / layout.SUMMARY)


def val_curve(run: RunDir) -> list[float]:
    """Validation accuracy after each epoch, from train/metrics.jsonl."""
    rows = [json.loads(line) for line in (run.path / layout.METRICS).read_text().splitlines()]
    return [row["val_accuracy"] for row in rows if "val_accuracy" in row]


def epochs_to(curve: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose validation accuracy reaches `target`; None if none does."""
    return next((i for i, acc in enumerate(curve, start=1) if acc >= target), None)


def measured(what: str, run: RunDir, summary: dict[str, Any]) -> None:
    """Print the numbers docs/how-to/own-images.md's table quotes (`pytest -s` shows them)."""
    keys = ("epochs", "global_batch", "lr", "val_accuracy", "eval_mode_accuracy", "train_mode_accuracy", "seconds")
    print(f"\n{what}: {json.dumps({k: summary[k] for k in keys})} curve {[round(a, 2) for a in val_curve(run)]}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return photos.build(tmp_path_factory.mktemp("photos") / "photos")


@pytest.fixture(scope="module")
def scratch(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunDir, dict[str, Any]]]:
    """From-scratch runs at the defaults, by model name, each trained once for the module."""
    runs: dict[str, tuple[RunDir, dict[str, Any]]] = {}
    for name in ("mobilenet_v3_small", "resnet18"):
        runs[name] = trained(photo_config(folder, f"model.name={name}"), tmp_path_factory.mktemp(name) / "run")
        measured(f"{name}, scratch", *runs[name])
    return runs


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "resnet18"])
def test_from_scratch_at_defaults_well_above_chance_and_eval_mode_matches_the_weights(
    scratch: dict[str, tuple[RunDir, dict[str, Any]]], name: str
) -> None:
    _, summary = scratch[name]
    # 115 training images on 2 ranks: auto gives batch 32 (4 steps an epoch), 30 epochs (120 steps), lr 1e-2.
    assert (summary["global_batch"], summary["epochs"], summary["lr"]) == (32, 30, 1e-2)
    assert summary["val_accuracy"] >= TARGET
    assert abs(summary["eval_mode_accuracy"] - summary["train_mode_accuracy"]) <= 0.1
    assert summary["warnings"] == []


def subset(folder: Path, root: Path, classes: tuple[str, ...]) -> Path:
    """The 5-class folder's training images (never its validation ones) of `classes` only."""
    splits = data.load(photo_config(folder).data, 0)
    for path, _ in splits.train.items:  # type: ignore[attr-defined]
        if path.parent.name in classes:
            dest = root / path.parent.name / path.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(path)
    return root


def test_fine_tuning_an_earlier_runs_weights_replaces_the_head_and_converges_faster(
    folder: Path, tmp_path: Path, scratch: dict[str, tuple[RunDir, dict[str, Any]]]
) -> None:
    model = "model.name=mobilenet_v3_small"
    four = subset(folder, tmp_path / "four", ("birds", "flowers", "fruit", "mammals"))
    earlier, _ = trained(photo_config(four, model), tmp_path / "a")
    consolidate.run(earlier.load_config(), earlier, log=lambda _: None)
    weights = earlier.path / layout.WEIGHTS
    tuned, summary = trained(photo_config(folder, model, f"model.weights={weights}"), tmp_path / "b")
    measured("mobilenet_v3_small, from the 4-class run", tuned, summary)
    assert sorted(summary["weights_dropped"]) == ["classifier.3.bias [4]", "classifier.3.weight [4, 1024]"]
    # data.normalize auto: the earlier run's own statistics, not ImageNet's; train.lr auto: 1e-3.
    recorded = read_json(earlier.path / layout.MODEL_JSON)["input"]
    assert (summary["normalization"], summary["lr"]) == ("weights", 1e-3)
    assert read_json(tuned.path / layout.DATASET)["mean"] == recorded["mean"]
    fast, slow = epochs_to(val_curve(tuned), TARGET), epochs_to(val_curve(scratch["mobilenet_v3_small"][0]), TARGET)
    print(f"epochs to {TARGET:.2f}: fine-tuned {fast}, scratch {slow}")
    assert fast is not None and (slow is None or fast < slow)
