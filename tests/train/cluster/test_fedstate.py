"""The controller's record of a federated run: each round's model a checkpoint that resumes where it stopped, and
that the consolidate stage reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline import layout
from pipeline.config import load_config
from pipeline.errors import PipelineError
from pipeline.train.cluster import fedstate


def test_a_stopped_run_resumes_from_its_last_round_with_its_statistics(tmp_path: Path) -> None:
    cfg = load_config(overrides=["model.name=small_cnn"])
    state = fedstate.State.resume(cfg, tmp_path, 10)
    assert state.model is None  # nothing yet: the census comes first
    state.begin(([0.5], [0.25]), 1)
    arrays = [a + 1 if a.dtype.kind == "f" else a + 3 for a in state.arrays()]
    state.save(1, arrays, 0.4)
    state.save(2, [a * 2 for a in arrays], 0.6)
    assert (tmp_path / layout.LATEST).resolve().name == "step-2"

    again = fedstate.State.resume(cfg, tmp_path, 10)
    assert (again.round, again.accuracy, again.stats, again.channels) == (2, 0.6, ([0.5], [0.25]), 1)
    assert all(np.array_equal(a, b * 2) for a, b in zip(again.arrays(), arrays, strict=True))
    other = load_config(overrides=["model.name=small_cnn", "data.image_size=24"])
    with pytest.raises(PipelineError, match="not written by this federated run"):
        fedstate.State.resume(other, tmp_path, 10)


def test_a_run_with_no_round_done_says_so(tmp_path: Path) -> None:
    state = fedstate.State(load_config(), tmp_path, 10)
    with pytest.raises(PipelineError, match="no federated round produced a model"):
        state.summary([str(c) for c in range(10)])
