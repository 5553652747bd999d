"""The few-round collectives on three real gloo ranks: the star's sum, the flat all-reduce and broadcast, and the
measured choice between ring and star, which every rank must make alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline.config import validate
from pipeline.train.compression import collectives
from pipeline.train.rank import runtime
from tests.train.ranks import run_ranks

WORLD = 3


def _rank_tensor(rank: int, shape: tuple[int, ...] = (17, 5)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank))


def each_collective(root: Path) -> None:
    """On each rank: every collective of the module on tensors of its own; writes what it ended with."""
    runtime.init(validate({}, "test").train)
    try:
        rank = dist.get_rank()
        star = _rank_tensor(rank).flatten()
        collectives.star_all_reduce(star)
        pieces = [_rank_tensor(rank, (3, 4)), _rank_tensor(10 + rank, (5,))]
        collectives.all_reduce_flat(pieces)
        ring = [_rank_tensor(rank, (3, 4)), _rank_tensor(10 + rank, (5,))]
        collectives.all_reduce_flat(ring, star=False)
        # BatchNorm's buffers: float statistics and an int64 batch count far above float32's exact range.
        buffers = [torch.full((4,), float(rank) + 0.1), torch.tensor(2**40 + 3 + rank)]
        collectives.broadcast_flat(buffers, src=1)
        fastest = collectives.Fastest()
        chosen = _rank_tensor(rank, (1000,))
        fastest.all_reduce(chosen)
        again = _rank_tensor(rank, (1000,))
        fastest.all_reduce(again)
        out = {
            "star": star.tolist(),
            "flat": [p.tolist() for p in pieces],
            "ring": [p.tolist() for p in ring],
            "buffers": [buffers[0].tolist(), int(buffers[1]), str(buffers[1].dtype)],
            "fastest": [fastest.star, list(fastest.seconds), chosen.tolist(), again.tolist()],
        }
        (root / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank ended with (one spawn for both tests)."""
    root = tmp_path_factory.mktemp("collectives")
    run_ranks(each_collective, root, world=WORLD)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _summed(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return sum((_rank_tensor(seed + r, shape) for r in range(WORLD)), torch.zeros(shape))


def test_star_flat_and_chosen_all_reduces_sum_every_rank_and_agree(ranks: list[dict[str, Any]]) -> None:
    for key in ("star", "flat", "fastest"):
        assert all(r[key] == ranks[0][key] for r in ranks), key  # the same bits on every rank, the same choice
    torch.testing.assert_close(torch.tensor(ranks[0]["star"]), _summed(0, (17, 5)).flatten())
    for key in ("flat", "ring"):
        got = [torch.tensor(p) for p in ranks[0][key]]
        torch.testing.assert_close(got, [_summed(0, (3, 4)), _summed(10, (5,))])
    star_won, seconds, chosen, again = ranks[0]["fastest"]
    assert isinstance(star_won, bool) and star_won == (seconds[1] < seconds[0]) and min(seconds) > 0
    for got in (chosen, again):  # the measuring call and the next one both sum
        torch.testing.assert_close(torch.tensor(got), _summed(0, (1000,)))


def test_broadcast_flat_copies_floats_and_large_counts_exactly(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        stats, count, dtype = rank["buffers"]
        assert stats == [torch.tensor(1.1).item()] * 4  # rank 1's float32 value, bit for bit
        assert (count, dtype) == (2**40 + 4, "torch.int64")
