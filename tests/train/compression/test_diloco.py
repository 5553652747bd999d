"""`diloco`'s outer step on two real gloo ranks: a Nesterov step on the averaged change, the same on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import validate
from pipeline.train.compression import diloco
from pipeline.train.rank import runtime
from tests.train.compression.helpers import rank_results

LR, MOMENTUM = 0.7, 0.9


def two_outer_steps(root: Path) -> None:
    """On each rank: parameters of its own, made one by the first outer step; then two rounds of a rank-specific move
    followed by an outer step. Writes the parameters after each outer step and the moves, and the bytes sent."""
    runtime.init(validate({}, "test").train)
    try:
        rank = dist.get_rank()
        params = [torch.randn(20, 5, generator=torch.Generator().manual_seed(rank)), torch.zeros(3)]
        outer = diloco.OuterStep(period=1, warmup_steps=0, lr=LR, momentum=MOMENTUM)
        sent = [outer.average(params)]
        after = [[p.tolist() for p in params]]
        moves = []
        for round_ in (1, 2):
            gens = [torch.Generator().manual_seed(100 * round_ + r) for r in (0, 1)]
            move = [[torch.randn(p.shape, generator=g) for p in params] for g in gens]
            moves.append([[m.tolist() for m in ms] for ms in move])
            for p, m in zip(params, move[rank], strict=True):
                p.add_(m)
            sent.append(outer.average(params))
            after.append([p.tolist() for p in params])
        (root / f"rank{rank}.json").write_text(json.dumps({"after": after, "moves": moves, "sent": sent}))
    finally:
        dist.destroy_process_group()


def test_the_outer_step_is_nesterov_on_the_averaged_change(tmp_path: Path) -> None:
    ranks = rank_results(two_outer_steps, tmp_path)
    assert ranks[0]["after"] == ranks[1]["after"]  # every rank continues from the same anchor
    anchor = [torch.tensor(a) for a in ranks[0]["after"][0]]
    start = [[torch.tensor(p) for p in r] for r in (ranks[0]["after"][0], ranks[1]["after"][0])]
    torch.testing.assert_close(anchor, start[0])
    velocity = [torch.zeros_like(a) for a in anchor]
    for round_, moves in enumerate(ranks[0]["moves"], start=1):
        # The pseudo-gradient: anchor minus where the ranks went, averaged: minus the mean move.
        grad = [-(torch.tensor(a) + torch.tensor(b)) / 2 for a, b in zip(*moves, strict=True)]
        velocity = [MOMENTUM * v + g for v, g in zip(velocity, grad, strict=True)]
        anchor = [a - LR * (g + MOMENTUM * v) for a, g, v in zip(anchor, grad, velocity, strict=True)]
        torch.testing.assert_close([torch.tensor(p) for p in ranks[0]["after"][round_]], anchor)
    assert ranks[0]["sent"] == [4 * (100 + 3)] * 3  # one fp32 all-reduce of the parameters per outer step
