"""The checkpoint directory's bookkeeping: ordering, the `latest` pointer, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.manifest import write_json
from pipeline.train import checkpoint


def _make(root: Path, *steps: int) -> None:
    for step in steps:
        write_json(root / f"step-{step}" / checkpoint.TRAINER_JSON, {"epoch": 0, "step": step})


def test_step_dirs_are_ordered_by_step_number_not_name(tmp_path: Path) -> None:
    _make(tmp_path, 9, 10, 100)
    (tmp_path / "step-x").mkdir()
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-100", "step-10", "step-9"]


def test_latest_is_none_without_a_pointer_and_follows_it_otherwise(tmp_path: Path) -> None:
    _make(tmp_path, 10, 20)
    assert checkpoint.latest(tmp_path) is None
    checkpoint._point_latest(tmp_path, "step-10")
    checkpoint._point_latest(tmp_path, "step-20")
    assert checkpoint.latest(tmp_path) == (tmp_path / "step-20").resolve()
    assert (tmp_path / "latest").readlink() == Path("step-20")  # relative: the run dir can move
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_latest_pointing_at_an_incomplete_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "step-5").mkdir()
    checkpoint._point_latest(tmp_path, "step-5")
    with pytest.raises(PipelineError, match=r"latest: points to step-5"):
        checkpoint.latest(tmp_path)


def test_prune_keeps_the_newest_and_never_the_one_latest_points_to(tmp_path: Path) -> None:
    _make(tmp_path, 10, 20, 30, 40)
    checkpoint._point_latest(tmp_path, "step-20")
    deleted = checkpoint.prune(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step-10", "step-30"]
    assert sorted(p.name for p in checkpoint.step_dirs(tmp_path)) == ["step-20", "step-40"]


def test_only_a_checkpoint_of_the_same_data_and_model_is_resumable(tmp_path: Path) -> None:
    ours, other = validate({}, "test"), validate({"data": {"image_size": 24}}, "test")
    assert checkpoint.resumable(tmp_path, ours) is None
    meta = {"epoch": 0, "step": 7, "resume_key": checkpoint.resume_key(ours)}
    write_json(tmp_path / "step-7" / checkpoint.TRAINER_JSON, meta)
    checkpoint._point_latest(tmp_path, "step-7")
    longer = validate({"train": {"epochs": 99}}, "test")  # train settings may change on resume
    assert checkpoint.resumable(tmp_path, longer) == (tmp_path / "step-7").resolve()
    with pytest.raises(PipelineError, match=r"step-7: written for a different data/model config"):
        checkpoint.resumable(tmp_path, other)
