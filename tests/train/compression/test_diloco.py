"""`diloco`'s outer step on two real gloo ranks: a Nesterov step on the averaged change, the same on every rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import layout
from pipeline.config import validate
from pipeline.train.compression import diloco, localsgd
from pipeline.train.compression.method import Epoch
from pipeline.train.rank import checkpoint, runtime
from tests.train.compression.helpers import mid_epoch_saves, rank_results

LR, MOMENTUM = 0.7, 0.9


def every_step() -> localsgd.Schedule:
    """An outer step after every step."""
    return localsgd.Schedule(1, 0, Epoch(1))


def two_outer_steps() -> dict[str, Any]:
    """On each rank: parameters of its own, made one by the first outer step; then two rounds of a rank-specific move
    followed by an outer step. The parameters after each outer step and the moves, and the bytes sent."""
    rank = dist.get_rank()
    params = [torch.randn(20, 5, generator=torch.Generator().manual_seed(rank)), torch.zeros(3)]
    outer = diloco.OuterStep(every_step(), lr=LR, momentum=MOMENTUM)
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
    return {"after": after, "moves": moves, "sent": sent}


def resumed_outer_steps() -> dict[str, Any]:
    """On each rank: three rounds of a rank-specific move and an outer step, run straight through; with the outer
    step rebuilt after the first round and given its state back (as a resume from a checkpoint does); and rebuilt
    without it (as resuming did before the state was kept)."""
    rank = dist.get_rank()
    ends = {}
    for how in ("straight", "restored", "forgotten"):
        params = [torch.randn(20, 5, generator=torch.Generator().manual_seed(rank))]
        outer = diloco.OuterStep(every_step(), lr=LR, momentum=MOMENTUM)
        outer.average(params)
        for round_ in (1, 2, 3):
            params[0].add_(torch.randn(20, 5, generator=torch.Generator().manual_seed(100 * round_ + rank)))
            outer.average(params)
            if round_ == 1 and how != "straight":
                saved = {k: v.clone() for k, v in outer.state(params).items()}
                outer = diloco.OuterStep(every_step(), lr=LR, momentum=MOMENTUM)
                if how == "restored":
                    template = outer.state(params)  # what a checkpoint's outer state is loaded into, in place
                    for key, tensor in template.items():
                        tensor.copy_(saved[key])
                    outer.restore(params, template)
        ends[how] = params[0].tolist()
    return ends


def every_scenario(root: Path) -> None:
    """On each rank, in one process group (one spawn for every test here): each scenario's results."""
    rt = runtime.init(validate({}, "test").train)
    try:
        out = {"fp32": two_outer_steps(), "int8": int8_outer_steps(), "settle": settle_between_outer_steps()}
        out["resumed"] = resumed_outer_steps()
        out["saves"] = mid_epoch_saves("diloco", root / "saves", rt)
        out["own"] = saves_of_a_device_of_its_own(root, rt)
        (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def saves_of_a_device_of_its_own(root: Path, rt: runtime.Runtime) -> dict[str, Any]:
    """As in a cluster job over SSH, each rank a device of its own with its own run directory, and no
    `checkpoint_every_steps`: the saves, and the steps whose outer step sent bytes (rank 0's metrics)."""
    run_dir = root / f"device-{rt.rank}"
    os.environ |= {checkpoint.PER_NODE_ENV: "1", "GROUP_RANK": str(rt.rank)}
    try:
        saves = mid_epoch_saves("diloco", run_dir, rt, every=None)
    finally:
        del os.environ[checkpoint.PER_NODE_ENV], os.environ["GROUP_RANK"]
    rows = [json.loads(line) for line in (root / "device-0" / layout.METRICS).read_text().splitlines()]
    return {"saves": saves, "sent": [r["step"] for r in rows if r.get("comm_bytes")]}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two ranks wrote."""
    return rank_results(every_scenario, tmp_path_factory.mktemp("diloco"))


def test_the_outer_step_is_nesterov_on_the_averaged_change(scenarios: list[dict[str, Any]]) -> None:
    ranks = [s["fp32"] for s in scenarios]
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


def test_a_resumed_outer_step_goes_on_as_if_never_stopped(scenarios: list[dict[str, Any]]) -> None:
    for rank in scenarios:
        ends = {how: torch.tensor(end) for how, end in rank["resumed"].items()}
        torch.testing.assert_close(ends["restored"], ends["straight"])
        # Without its momentum and anchor the next outer step only averages: somewhere else.
        assert not torch.allclose(ends["forgotten"], ends["straight"], atol=1e-3)


def test_a_checkpoint_asked_for_mid_period_waits_for_the_next_outer_step(scenarios: list[dict[str, Any]]) -> None:
    saves = [s["saves"] for s in scenarios]
    mid = [(a, b) for a, b in zip(*saves, strict=True) if a["next_batch"]]
    assert mid and all(a["step"] >= 5 for a, _ in mid)
    for a, b in mid:
        # The models were one when saved (each rank trains alone between outer steps): the checkpoint is theirs.
        assert a["step"] == b["step"] and a["params"] == b["params"]


def test_a_device_of_its_own_checkpoints_after_every_outer_step(scenarios: list[dict[str, Any]]) -> None:
    """A device lost for good costs the others at most the outer step in flight: each device saves after every one,
    with nothing asked, and each save is the models made one."""
    own = [s["own"] for s in scenarios]
    outer_steps = [step for step in own[0]["sent"] if step > 1]  # step 1 sends the first whole models
    assert len(outer_steps) >= 2
    for rank in own:
        assert [s["step"] for s in rank["saves"]] == outer_steps  # the last one closes the epoch
    for a, b in zip(own[0]["saves"], own[1]["saves"], strict=True):
        assert a["params"] == b["params"]


def int8_outer_steps() -> dict[str, Any]:
    """As two_outer_steps, with the same moves, but the change goes in 8 bits (`outer_int8`, the default)."""
    rank = dist.get_rank()
    params = [torch.randn(20, 5, generator=torch.Generator().manual_seed(rank)), torch.zeros(3)]
    outer = diloco.OuterStep(every_step(), lr=LR, momentum=MOMENTUM, int8=True)
    sent = [outer.average(params)]
    for round_ in (1, 2):
        gen = torch.Generator().manual_seed(100 * round_ + rank)  # two_outer_steps' moves
        move = [torch.randn(p.shape, generator=gen) for p in params]
        for p, m in zip(params, move, strict=True):
            p.add_(m)
        sent.append(outer.average(params))
    return {"after": [p.tolist() for p in params], "sent": sent}


def test_int8_outer_steps_agree_on_every_rank_close_to_fp32_in_a_quarter_of_the_bytes(
    scenarios: list[dict[str, Any]],
) -> None:
    int8, fp32 = [s["int8"] for s in scenarios], [s["fp32"] for s in scenarios]
    assert int8[0]["after"] == int8[1]["after"]  # the same gathered payloads, summed in the same order
    for got, exact in zip(int8[0]["after"], fp32[0]["after"][-1], strict=True):
        error = (torch.tensor(got) - torch.tensor(exact)).abs().max().item()
        assert 0 < error < 0.1  # moves up to ~4: a few rounding steps of max/127, carried by error feedback
    assert int8[0]["sent"] == [4 * (100 + 3), 100 + 3 + 2 * 4, 100 + 3 + 2 * 4]  # the first in fp32, then int8


def settle_between_outer_steps() -> dict[str, Any]:
    """On each rank: the first outer step, a move of its own that is not yet due for an outer step, then the epoch's
    end settling it; then a second settle with nothing to do. The parameters and the bytes of each call."""
    rank = dist.get_rank()
    params = [torch.randn(20, 5, generator=torch.Generator().manual_seed(rank))]
    # Epochs of 4 steps with one averaging each, the first process step the epoch's last (a resume mid-epoch).
    outer = diloco.OuterStep(localsgd.Schedule(4, 0, Epoch(4, done=3)), lr=LR, momentum=MOMENTUM)
    sent = [outer.average(params)]
    params[0].add_(torch.randn(20, 5, generator=torch.Generator().manual_seed(10 + rank)))
    sent += [outer.average(params), outer.settle(params), outer.settle(params)]
    return {"after": params[0].tolist(), "sent": sent}


def test_the_epochs_end_makes_the_ranks_models_one_with_an_outer_step_only_when_they_differ(
    scenarios: list[dict[str, Any]],
) -> None:
    ranks = [s["settle"] for s in scenarios]
    assert ranks[0]["after"] == ranks[1]["after"]
    assert ranks[0]["sent"] == [400, 0, 400, 0]  # an outer step at the end of the epoch, then nothing to do
