"""What `auto` batch size, epochs and learning rate become: the digits keep the quickstart's settings, a small
image folder gets enough optimizer steps, a weights file a lower rate; set values are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import TrainConfig
from pipeline.layout import METRICS
from pipeline.manifest import RunDir
from pipeline.train.compression import registry
from pipeline.train.rank.plan import plan, scaled_epochs, steps_per_epoch


def test_the_digits_keep_the_quickstart_settings() -> None:
    got = plan(TrainConfig(), train_size=1437, world_size=2, pretrained=False)
    assert (got.batch_size, got.epochs, got.lr) == (64, 8, 1e-2)


def test_a_small_image_folder_gets_smaller_batches_and_enough_steps() -> None:
    got = plan(TrainConfig(), train_size=115, world_size=2, pretrained=False)  # the photo folder's training split
    assert (got.batch_size, got.epochs) == (32, 30)
    assert steps_per_epoch(115, 32, 2) * got.epochs >= 120
    assert got.why[0] == "train.batch_size auto: 32 (at least 4 steps an epoch of 115 images)"
    assert got.why[1] == "train.epochs auto: 30 (at least 120 optimizer steps, 4 an epoch)"


@pytest.mark.parametrize(("size", "ranks", "batch"), [(9, 2, 8), (3, 2, 2), (40, 4, 40), (200, 4, 64), (100, 1, 32)])
def test_the_batch_never_exceeds_the_split_nor_drops_below_16_a_rank_while_images_last(
    size: int, ranks: int, batch: int
) -> None:
    assert plan(TrainConfig(), train_size=size, world_size=ranks, pretrained=False).batch_size == batch


@pytest.mark.parametrize("method", ["diloco", "localsgd"])
def test_methods_that_average_models_get_twice_the_auto_epochs_and_set_epochs_stay(method: str) -> None:
    got = plan(TrainConfig(compression=method), train_size=1437, world_size=2, pretrained=False)
    assert got.epochs == 16
    why = f"train.epochs auto: 16 (at least 120 optimizer steps, 23 an epoch; 2x that for {method}, which averages"
    assert got.why[1] == f"{why} models)"
    assert plan(TrainConfig(compression=method, epochs=8), 1437, 2, pretrained=False).epochs == 8
    assert plan(TrainConfig(compression="star"), 1437, 2, pretrained=False).epochs == 8


def test_auto_compression_choosing_diloco_doubles_a_set_epoch_count_and_says_so() -> None:
    planned = plan(TrainConfig(compression="auto", epochs=8), 1437, 2, pretrained=False)
    got = scaled_epochs(planned, registry.METHODS["diloco"], "chosen by compression auto")
    assert got.epochs == 16 and (got.batch_size, got.lr) == (planned.batch_size, planned.lr)
    assert got.why[-1] == "train.epochs 8 -> 16: diloco, chosen by compression auto, averages models (2x)"


def test_a_weights_file_trains_at_a_tenth_of_the_rate_and_set_values_stay() -> None:
    assert plan(TrainConfig(), 115, 2, pretrained=True).lr == 1e-3
    fixed = plan(TrainConfig(batch_size=10, epochs=3, lr=0.5), 115, 2, pretrained=True)
    assert (fixed.batch_size, fixed.epochs, fixed.lr, fixed.why) == (10, 3, 0.5, ())


def test_the_flows_progress_reads_what_auto_epochs_became_from_the_epoch_lines(tmp_path: Path) -> None:
    from flows.progress import epochs_done, epochs_planned

    run = RunDir(tmp_path)
    assert epochs_planned(run, "auto") is None and epochs_planned(run, 5) == 5  # before the first epoch ends
    (tmp_path / METRICS).parent.mkdir(parents=True)
    rows = [{"step": 4, "epoch": 0, "loss": 1.0}, {"epoch": 0, "epochs": 30, "val_accuracy": 0.3}]
    (tmp_path / METRICS).write_text("".join(f"{json.dumps(row)}\n" for row in rows))
    assert (epochs_done(run), epochs_planned(run, "auto")) == (1, 30)
    assert epochs_planned(run, 15) == 30  # a set count `compression = "auto"` doubled for DiLoCo
