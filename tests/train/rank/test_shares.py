"""Shares of the batch in proportion to the ranks' speeds: the split, the loss weights that keep the averaged gradient
the whole batch's, each rank's images; and two real ranks, one held to a fraction of a core by its cgroup."""

from __future__ import annotations

import collections
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from pipeline import layout
from pipeline.config import validate
from pipeline.train.rank import checkpoint, runtime, shares
from pipeline.train.rank.worker import Trainer
from tests.harness import cgroup
from tests.train.ranks import run_ranks


def _timings(batch: int, forward_s: list[float], optimizer_s: float = 0.0) -> list[shares.Timing]:
    return [shares.Timing(batch, f, optimizer_s) for f in forward_s]


def test_steps_within_the_tolerance_keep_equal_shares() -> None:
    assert shares.split(64, _timings(16, [0.10, 0.11, 0.09, 0.13])) == [16] * 4  # noise on a shared CPU
    assert shares.split(64, _timings(16, [0.10, 0.0, 0.10, 0.10])) == [16] * 4  # a rank that measured nothing
    # Twice as slow a forward pass, but the same optimizer step, which most of a step is: within 1.5x.
    assert shares.split(64, _timings(16, [0.01, 0.01, 0.01, 0.02], optimizer_s=0.2)) == [16] * 4
    # Twice as slow, but on a link where a step takes 0.75 s: a few milliseconds to gain are not worth a reshuffle.
    slow_link = [shares.Timing(16, f, 0.001, step_s=0.75) for f in (0.002, 0.002, 0.002, 0.004)]
    assert shares.split(64, slow_link) == [16] * 4
    assert shares.split(64, [replace(t, step_s=0.02) for t in slow_link]) != [16] * 4  # where the step is compute


def test_a_half_speed_rank_gets_half_a_share_and_the_sum_is_kept() -> None:
    assert shares.split(64, _timings(16, [0.1, 0.1, 0.1, 0.2])) == [19, 18, 18, 9]
    assert shares.split(32, _timings(16, [0.01, 1.0])) == [28, 4]  # never below a quarter of an equal share
    for forward in ([1.0, 3.0], [1.0, 5.0, 5.0], [1.0, 1.4, 5.0, 10.0, 10.0]):
        got = shares.split(60, _timings(12, forward))
        assert sum(got) == 60 and min(got) >= 3
        assert got == sorted(got, reverse=True)  # faster, never fewer


def test_what_a_step_costs_whatever_its_batch_is_left_out_of_the_share() -> None:
    """A rank whose optimizer step is slow can give away images, not its optimizer step; a forward pass's own cost,
    found from two epochs at different batches, neither."""
    slow_optimizer = [shares.Timing(16, 0.05, 0.05), shares.Timing(16, 0.10, 0.10)]
    fixed, per_image = shares.cost(slow_optimizer[1])
    assert (fixed, per_image) == pytest.approx((0.10, 3 * 0.10 / 16))
    batches = shares.split(32, slow_optimizer)
    times = [shares.cost(t)[0] + shares.cost(t)[1] * b for t, b in zip(slow_optimizer, batches, strict=True)]
    assert batches == [23, 9] and times[1] == pytest.approx(times[0], rel=0.02)  # in proportion: 21/11
    # 0.02 s a forward pass whatever its batch, and 1 ms an image: the line through two epochs finds both.
    before, now = shares.Timing(16, 0.036, 0.0), shares.Timing(8, 0.028, 0.0)
    assert shares.cost(now, before) == pytest.approx((3 * 0.02, 3 * 0.001))
    assert shares.cost(now, shares.Timing(16, 0.01, 0.0)) == pytest.approx((0.0, 3 * 0.028 / 8))  # implausible line


def test_weighted_losses_average_to_the_whole_batchs_gradient() -> None:
    """What DDP computes, the mean over the ranks of each rank's gradient of its weighted loss, is the gradient of the
    mean loss over the whole batch, whatever the shares."""
    torch.manual_seed(0)
    net = models.build_model("small_cnn", 10, 1).eval()  # eval: BatchNorm by its running statistics, per image
    x, y = torch.randn(24, 1, 16, 16), torch.arange(24) % 10
    whole = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    batches = [15, 6, 3]
    parts = zip(x.split(batches), y.split(batches), strict=True)
    per_rank = [
        torch.autograd.grad(F.cross_entropy(net(xs), ys) * shares.loss_weight(batches, r), list(net.parameters()))
        for r, (xs, ys) in enumerate(parts)
    ]
    averaged = [sum(g) / len(batches) for g in zip(*per_rank, strict=True)]
    torch.testing.assert_close(averaged, list(whole))


def test_each_rank_cuts_its_share_of_one_permutation() -> None:
    batches, steps = [5, 2, 1], 3
    cut = [list(shares.sampler(30, steps, batches, r, 0, seed=7)) for r in range(3)]
    assert [len(c) for c in cut] == [15, 6, 3]
    assert len(set().union(*map(set, cut))) == 24  # disjoint while the shares fit the split
    again = shares.sampler(30, steps, batches, 1, 0, seed=7)
    again.set_epoch(1)
    assert list(again) != cut[1] and len(list(again)) == 6  # a new permutation each epoch
    wrapped = [list(shares.sampler(10, steps, batches, r, 0, seed=7)) for r in range(3)]
    counts = collections.Counter(i for c in wrapped for i in c)  # 24 of 10 images: round the permutation again
    assert set(counts) == set(range(10)) and set(counts.values()) == {2, 3}


def test_a_rank_slower_than_the_median_trains_that_share_of_the_steps() -> None:
    """Under the methods that average models: a rank twice the median's compute trains every other step, one four
    times slower no fewer than MIN_SHARE of them; within the tolerance, or where a step is mostly the link's wait,
    every rank trains every step."""
    half = [shares.Timing(16, f, 0.01, step_s=0.1) for f in (0.03, 0.03, 0.03, 0.065)]
    assert shares.paces(half) == pytest.approx([1.0, 1.0, 1.0, 0.1 / 0.205])
    assert shares.paces([replace(t, forward_s=0.3) for t in half[:3]] + half[3:])[3] == 1.0  # the others slower
    stalled = [*half[:3], replace(half[3], forward_s=1.0)]
    assert shares.paces(stalled)[3] == shares.MIN_SHARE
    assert shares.paces([shares.Timing(16, f, 0.01, step_s=0.1) for f in (0.03, 0.04)]) == [1.0, 1.0]
    noisy = [shares.Timing(16, f, 0.01, step_s=0.2) for f in (0.052, 0.063, 0.061, 0.197)]  # measured: 4 on 2 cores
    assert shares.paces(noisy)[:3] == [1.0] * 3  # the second, 3% over the median, trains every step
    waiting = [replace(t, step_s=5.0) for t in half]  # the link's seconds dwarf what pacing would save
    assert shares.paces(waiting) == [1.0] * 4


def train_with_one_rank_held(root: Path, procs: str, compression: str) -> None:
    """On each rank: 3 epochs of resnet18 at 32 px on the digits; rank 1 first moves itself into the held cgroup."""
    train = {"epochs": 3, "batch_size": 64, "compression": compression}
    cfg = validate({"model": {"name": "resnet18"}, "data": {"image_size": 32}, "train": train}, "test")
    rt = runtime.init(cfg.train)
    try:
        if dist.get_rank() == 1:
            Path(procs).write_text(str(os.getpid()))
        summary = Trainer(cfg, root, rt).fit()
        (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(cgroup.unavailable() is not None, reason=f"CPU quota: {cgroup.unavailable()}")
def test_a_rank_held_to_a_fraction_of_a_core_gets_a_smaller_share(tmp_path: Path) -> None:
    with cgroup.cpu_quota(0.25) as procs:
        run_ranks(train_with_one_rank_held, tmp_path, str(procs), "none")
    lines = [json.loads(x) for x in (tmp_path / layout.METRICS).read_text().splitlines()]
    epochs = [r for r in lines if "val_accuracy" in r]
    fast, slow = epochs[0]["forward_s"]
    assert slow > 1.5 * fast  # the held rank measured slower
    first, later = epochs[0]["next_batches"], epochs[-1]["next_batches"]
    assert first[0] > first[1] and sum(first) == 64 and later[0] > later[1]
    steps: dict[int, list[Any]] = {}
    for r in (x for x in lines if "loss" in x):
        steps.setdefault(r["epoch"], []).append(r)
    assert len({len(s) for s in steps.values()}) == 1  # every epoch the same number of steps, shares or not
    assert all(r["batch"] == 64 for r in steps[1])  # the global batch is kept
    assert epochs[-1]["val_accuracy"] >= 0.8


@pytest.mark.slow
@pytest.mark.skipif(cgroup.unavailable() is not None, reason=f"CPU quota: {cgroup.unavailable()}")
def test_under_diloco_a_rank_held_to_a_fraction_of_a_core_trains_a_share_of_the_steps(tmp_path: Path) -> None:
    """The same held rank under `diloco`: its share of the batch stays whole, it trains fewer of the steps (no
    collective waits for a step it skips: the run ends), and the run still learns."""
    with cgroup.cpu_quota(0.25) as procs:
        run_ranks(train_with_one_rank_held, tmp_path, str(procs), "diloco")
    lines = [json.loads(x) for x in (tmp_path / layout.METRICS).read_text().splitlines()]
    epochs = [r for r in lines if "val_accuracy" in r]
    fast, slow = epochs[0]["forward_s"]
    assert slow > 1.5 * fast
    assert all(e["next_batches"] == [32, 32] for e in epochs)
    fast_pace, slow_pace = epochs[0]["next_paces"]
    assert fast_pace == 1.0 and shares.MIN_SHARE <= slow_pace < 0.75
    assert all(r["trained"] for r in lines if "loss" in r)  # rank 0, the fast one, logs: it trains every step
    assert epochs[-1]["val_accuracy"] >= 0.8


def resume_mid_epoch_with_shares(root: Path) -> None:
    """On each rank: 2 epochs of `none` with shares of 192 and 64 images from the first epoch's end, checkpointed every
    2 steps; straight through, and again stopped after step 8 (mid-epoch 2) and resumed: the final models and steps."""
    shares.split = lambda total, now, before=None, tolerance=shares.TOLERANCE: [3 * total // 4, total // 4]
    train = {"epochs": 2, "batch_size": 256, "compression": "none", "checkpoint_every_steps": 2, "keep_checkpoints": 9}
    cfg = validate({"train": train}, "test")
    rt = runtime.init(cfg.train)
    try:
        ends = {}
        for how in ("straight", "resumed"):
            trainer = Trainer(cfg, root / how, rt)
            summary = trainer.fit()
            if how == "resumed":  # stop after step 8: the checkpoints past it were never written
                checkpoints = root / how / layout.CHECKPOINTS
                if dist.get_rank() == 0:
                    for step in (10, 12):
                        shutil.rmtree(checkpoints / f"step-{step}")
                    checkpoint.point_latest(checkpoints, "step-8")
                dist.barrier()
                trainer = Trainer(cfg, root / how, rt)
                summary = trainer.fit()
            params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
            ends[how] = {"params": params.tolist(), "steps": summary["steps"]}
        (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(ends))
    finally:
        dist.destroy_process_group()


def test_a_run_resumed_mid_epoch_goes_on_with_its_shares_as_if_never_stopped(tmp_path: Path) -> None:
    run_ranks(resume_mid_epoch_with_shares, tmp_path)
    for rank in (0, 1):
        ends = json.loads((tmp_path / f"rank{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(ends["resumed"]["params"]), torch.tensor(ends["straight"]["params"]))
        assert ends["resumed"]["steps"] == ends["straight"]["steps"] == 12
    meta = json.loads((tmp_path / "resumed" / layout.CHECKPOINTS / "step-8" / "trainer.json").read_text())
    assert meta["batches"] == [192, 64] and meta["next_batch"] == 2  # saved mid-epoch 2, with its shares
