"""Pieces of the worker and the stage that need no process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import data, train
from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.files import sha256_file
from pipeline.train.compression.method import CommCounter
from pipeline.train.rank.worker import per_rank_batch


def test_per_rank_batch_splits_the_global_batch() -> None:
    assert per_rank_batch(64, 2) == 32
    assert per_rank_batch(65, 2) == 32
    with pytest.raises(PipelineError, match=r"train\.batch_size: 1 is smaller than the number of ranks \(2\)"):
        per_rank_batch(1, 2)


def test_comm_counter_take_resets() -> None:
    counter = CommCounter()
    counter.add(10, 0.5)
    counter.add(5)
    assert counter.take() == (15, 0.5)
    assert counter.take() == (0, 0.0)


def test_fingerprints_cover_data_and_initial_weights(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"not really weights")
    cfg = validate({"model": {"weights": str(weights)}}, "test")
    assert train.fingerprints(cfg) == {"data": data.fingerprint(cfg.data), "weights": sha256_file(weights)}
    weights.unlink()
    with pytest.raises(PipelineError, match=r"model\.weights: .*w\.safetensors"):
        train.fingerprints(cfg)
