"""`localsgd`'s 8-bit averaging on two real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeline.config import validate
from pipeline.train.compression import localsgd
from pipeline.train.compression.method import Epoch
from pipeline.train.rank import runtime
from tests.train.compression.helpers import rank_results


def average_int8(root: Path) -> None:
    """On each rank: parameters of its own, averaged once in fp32 (no anchor yet), then moved by a rank-specific
    delta and averaged in 8 bits; writes what it ends with, the exact mean of the moves and the bytes sent."""
    runtime.init(validate({}, "test").train)
    try:
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(rank)
        params = [torch.randn(100, 10, generator=gen), torch.randn(7, generator=gen)]
        averager = localsgd.Int8DeltaAverager(localsgd.Schedule(1, 0, Epoch(1)))
        averager.average(params)
        first = [p.clone() for p in params]
        gens = [torch.Generator().manual_seed(10 + r) for r in (0, 1)]
        moves = [[torch.randn(p.shape, generator=g) for p in params] for g in gens]
        for p, move in zip(params, moves[rank], strict=True):
            p.add_(move)
        sent = averager.average(params)
        exact = [f + (a + b) / 2 for f, a, b in zip(first, *moves, strict=True)]
        out = {"params": [p.tolist() for p in params], "exact": [e.tolist() for e in exact], "sent": sent}
        (root / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_int8_local_sgd_averaging_agrees_on_every_rank_in_a_quarter_of_the_bytes(tmp_path: Path) -> None:
    ranks = rank_results(average_int8, tmp_path)
    assert ranks[0]["params"] == ranks[1]["params"]  # bit-identical: the same payloads summed in the same order
    for got, exact in zip(ranks[0]["params"], ranks[0]["exact"], strict=True):
        error = (torch.tensor(got) - torch.tensor(exact)).abs().max().item()
        assert 0 < error < 0.05  # int8 of moves up to ~4: half a step of max/127 per rank
    assert ranks[0]["sent"] == 1000 + 7 + 2 * 4  # one byte per entry, one fp32 scale per tensor


def due_steps(schedule: localsgd.Schedule, steps: int) -> list[int]:
    return [step for step in range(steps) if schedule.tick()]


def test_averagings_are_spread_over_each_epoch_and_the_last_is_its_last_step() -> None:
    """round(S / period) averagings an epoch, the last on its last step, so that the epoch's end has nothing to
    settle: 23 steps at period 8 get three (where every 8th step from the first and a settle made four), 9 steps one
    (not two)."""
    assert due_steps(localsgd.Schedule(8, 0, Epoch(23)), 46) == [7, 15, 22, 30, 38, 45]
    nine = localsgd.Schedule(8, 0, Epoch(9))
    assert due_steps(nine, 9) == [8] and not nine.settle_due()
    assert due_steps(localsgd.Schedule(8, 0, Epoch(3)), 6) == [2, 5]  # an epoch shorter than the period: one each
    # A resume 5 steps into a 23-step epoch goes on with the same steps; warm-up (in sync) averages nothing.
    assert due_steps(localsgd.Schedule(8, 0, Epoch(23, done=5)), 41) == [2, 10, 17, 25, 33, 40]
    warm = localsgd.Schedule(8, 10, Epoch(23))
    assert due_steps(warm, 23) == [15, 22] and warm.in_sync
    # What a cluster job's device checkpoints after (worker: save_averaged): the averagings, not the warm-up's steps,
    # whose models DDP keeps one too.
    warm = localsgd.Schedule(8, 10, Epoch(23))
    averaged = []
    for step in range(23):
        warm.tick()
        averaged += [step] if warm.averaged else []
    assert averaged == [15, 22]
    between = localsgd.Schedule(8, 0, Epoch(23))
    due_steps(between, 9)
    assert not between.in_sync and between.settle_due()  # mid-epoch the models differ: a settle is needed


def paced_averaging(root: Path) -> None:
    """On each rank, from equal parameters: rank 1 at half pace; for 4 steps each rank adds its own move at each step
    it trains (rank 0: 1, rank 1: 10), and the fp32 averager averages at the epoch's end."""
    runtime.init(validate({}, "test").train)
    try:
        rank = dist.get_rank()
        schedule = localsgd.Schedule(4, 0, Epoch(4))
        schedule.pace([1.0, 0.5])
        averager = localsgd.Fp32Averager(schedule)
        params, trained = [torch.zeros(3)], []
        for step in range(4):
            if schedule.trains(rank):
                trained.append(step)
                params[0].add_(1.0 if rank == 0 else 10.0)
            averager.average(params)
        out = {"params": params[0].tolist(), "trained": trained, "weights": schedule.weights}
        (root / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_a_paced_rank_trains_its_share_of_the_steps_and_counts_for_that_share(tmp_path: Path) -> None:
    """Rank 1 trains steps 1 and 3 of 4; the average weighs the ranks 4 : 2 by the steps they trained
    ((4/3 · 4 + 2/3 · 20) / 2 = 9.33, where the plain mean would be 12)."""
    ranks = rank_results(paced_averaging, tmp_path)
    assert [r["trained"] for r in ranks] == [[0, 1, 2, 3], [1, 3]]
    assert ranks[0]["weights"] == ranks[1]["weights"] == pytest.approx([4 / 3, 2 / 3])
    for r in ranks:
        assert r["params"] == pytest.approx([(4 / 3 * 4 + 2 / 3 * 20) / 2] * 3)


def test_a_paced_rank_trains_every_step_of_the_warm_up() -> None:
    """In warm-up DDP all-reduces every step's gradients: no rank may skip one."""
    schedule = localsgd.Schedule(4, 4, Epoch(8))
    schedule.pace([1.0, 0.25])
    trains = []
    for _ in range(8):
        trains.append(schedule.trains(1))
        schedule.tick()
    assert trains == [True] * 4 + [False, False, False, True]
