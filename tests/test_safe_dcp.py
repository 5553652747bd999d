"""Checkpoints are read without running what a user could have planted in them: on resume as in consolidate."""

from __future__ import annotations

import enum
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipeline import safe_dcp
from pipeline.config import load_config
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.manifest import create_run_dir
from pipeline.train.rank import checkpoint


class Payload:
    """Unpickling this creates `marker`: proof that the pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _save(step_dir: Path, extra: object) -> dict[str, object]:
    state = {"model": {"w": torch.arange(4.0)}, "optim": {"lr": 0.1, "extra": extra}}
    dcp.save(state, checkpoint_id=step_dir, no_dist=True)
    return state


def test_plain_non_tensor_items_load(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", "adamw")
    into = {"model": {"w": torch.zeros(4)}, "optim": {"lr": 0.0, "extra": None}}
    safe_dcp.load(into, tmp_path / "step-1", no_dist=True)
    assert torch.equal(into["model"]["w"], torch.arange(4.0))
    assert into["optim"] == {"lr": 0.1, "extra": "adamw"}


def test_a_planted_non_tensor_item_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _save(tmp_path / "step-1", Payload(marker))
    into = {"model": {"w": torch.zeros(4)}, "optim": {"lr": 0.0, "extra": None}}
    with pytest.raises(PipelineError, match=r"step-1: cannot read checkpoint: refusing checkpoint item optim\.extra"):
        safe_dcp.load(into, tmp_path / "step-1", no_dist=True)
    assert not marker.exists()


def test_resume_refuses_planted_metadata_before_any_rank_starts(tmp_path: Path) -> None:
    """`pipeline train` on a run whose latest checkpoint carries a planted `.metadata`: one line, exit 2."""
    cfg = load_config()
    run = create_run_dir(cfg, tmp_path / "run")
    step_dir = run.path / "train/checkpoints/step-3"
    step_dir.mkdir(parents=True)
    write_json(step_dir / checkpoint.TRAINER_JSON, {"epoch": 0, "step": 3, "resume_key": checkpoint.resume_key(cfg)})
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (step_dir / "__0_0.distcp").write_bytes(b"")
    os.symlink("step-3", run.path / "train/checkpoints/latest")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run.path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to load" in lines[0] and ".metadata" in lines[0], proc.stderr
    assert not marker.exists()
    assert not (run.path / "train/metrics.jsonl").exists()  # no rank started


class _ByNamePickler(pickle.Pickler):
    """Pickles enum members by name, `getattr(cls, name)`, as Python 3.11.0-3.11.3 do (Debian 12's python3)."""

    def __init__(self, fh: object, target: object = None) -> None:
        super().__init__(fh)
        self.target = target  # when set, every enum member becomes getattr(target, its name) instead

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, enum.Enum):
            return getattr, (self.target or type(obj), obj.name)
        return NotImplemented


def _rewrite_metadata(step_dir: Path, target: object = None) -> None:
    path = step_dir / safe_dcp.METADATA
    metadata = pickle.loads(path.read_bytes())
    with path.open("wb") as fh:
        _ByNamePickler(fh, target).dump(metadata)


def test_metadata_pickled_by_python_3_11_2_loads(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", "adamw")
    _rewrite_metadata(tmp_path / "step-1")
    assert b"getattr" in (tmp_path / "step-1" / safe_dcp.METADATA).read_bytes()
    into = {"model": {"w": torch.zeros(4)}, "optim": {"lr": 0.0, "extra": None}}
    safe_dcp.load(into, tmp_path / "step-1", no_dist=True)
    assert torch.equal(into["model"]["w"], torch.arange(4.0))


def test_getattr_in_metadata_reaches_enum_members_only(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", "adamw")
    _rewrite_metadata(tmp_path / "step-1", target=safe_dcp.Metadata)  # getattr(Metadata, "TORCH_...")
    with pytest.raises(PipelineError, match=r"corrupt checkpoint metadata: refusing to load getattr\("):
        safe_dcp.read_metadata(tmp_path / "step-1")
