"""`localsgd`'s 8-bit averaging on two real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

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
    between = localsgd.Schedule(8, 0, Epoch(23))
    due_steps(between, 9)
    assert not between.in_sync and between.settle_due()  # mid-epoch the models differ: a settle is needed
