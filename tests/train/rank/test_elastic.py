"""Elastic training under real torchrun: a rank SIGKILLed mid-run restarts the group, which resumes from `latest`."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

import models
from pipeline import layout, train
from pipeline.config import Config, validate
from pipeline.files import read_json
from pipeline.manifest import create_run_dir
from pipeline.train.rank import checkpoint, runtime
from pipeline.train.rank.worker import Trainer
from tests.train.ranks import run_ranks
from tests.train.test_stage import rank_processes, small_config

KILL_AFTER_STEP = 30  # in the second of three 23-step epochs, after the step-30 checkpoint


def _rank_one(run_dir: Path) -> int | None:
    """Pid of the worker with RANK=1 (not torchrun itself)."""
    for pid in rank_processes(run_dir):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" not in argv and b"RANK=1" in environ:
            return pid
    return None


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / layout.METRICS).read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.endswith("}")]
    return max(steps, default=0)


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_which_resumes_and_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    # Background saves (CUDA's default): the harder case, as a write may be in flight when the rank dies.
    cfg = small_config(epochs=3, checkpoint_every_steps=10, max_restarts=2, keep_checkpoints=2, checkpoint_async=True)
    straight = create_run_dir(cfg, tmp_path / "straight")
    train.run(cfg, straight, log=lambda _: None)

    run = create_run_dir(cfg, tmp_path / "killed")
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = train.run(cfg, run, log=lambda _: None)
        except Exception as err:  # reported by the assertions below
            outcome["error"] = err

    worker = threading.Thread(target=target)
    worker.start()
    deadline = time.monotonic() + 120
    while _last_step(run.path) < KILL_AFTER_STEP + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = _rank_one(run.path)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    worker.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].status == "done"
    # the restarted group resumed from a step checkpoint, not from scratch: every step is logged once
    lines = [json.loads(x) for x in (run.path / layout.METRICS).read_text().splitlines()]
    assert [r["step"] for r in lines if "step" in r] == list(range(1, 3 * 23 + 1))
    ours, theirs = read_json(run.path / layout.SUMMARY), read_json(straight.path / layout.SUMMARY)
    assert abs(ours["val_accuracy"] - theirs["val_accuracy"]) <= 0.01
    assert checkpoint.latest(run.path / layout.CHECKPOINTS) is not None


def _tiny(asynchronous: bool) -> Config:
    """Two epochs of 3 steps each: the second epoch's save is the one that dies."""
    train = {"epochs": 2, "batch_size": 128, "checkpoint_async": asynchronous}
    return validate({"train": train, "data": {"val_fraction": 0.85}}, "test")


def _die_in_second_save(root: Path, asynchronous: bool) -> None:
    """Rank 0 exits hard (no cleanup, like SIGKILL) in its second save: after the shards, before `latest` moves."""
    rt = runtime.init(_tiny(asynchronous).train)
    real, calls = checkpoint.write_json, [0]

    def dying(path: Path, data: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            os._exit(9)
        real(path, data)

    checkpoint.write_json = dying
    Trainer(_tiny(asynchronous), root, rt).fit()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_a_kill_during_a_save_leaves_latest_on_the_previous_complete_checkpoint(
    tmp_path: Path, asynchronous: bool
) -> None:
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        run_ranks(_die_in_second_save, tmp_path, asynchronous)
    root = tmp_path / layout.CHECKPOINTS
    assert (root / "step-6").is_dir() and not (root / "step-6" / checkpoint.TRAINER_JSON).exists()
    found = checkpoint.resumable(root, _tiny(asynchronous))
    assert found == (root / "step-3").resolve()
    model = models.build_model("small_cnn", 10, 1)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=found, no_dist=True)
    model.load_state_dict(state["model"])  # complete and loadable
