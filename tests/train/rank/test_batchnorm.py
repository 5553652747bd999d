"""BatchNorm recalibration and the eval-mode check: on one process, and averaged over two ranks under DDP and FSDP."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.train.rank import batchnorm
from tests.train.ranks import run_ranks

CPU = torch.device("cpu")


def plain() -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


def check_modes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> batchnorm.ModeCheck | None:
    """The eval-mode check on one process (the worker sums the counts over ranks)."""
    counts = batchnorm.mode_counts(model, x, y, plain)
    return None if counts is None else batchnorm.ModeCheck.from_counts(counts)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo group of one process, for the all-reduces."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def offsets_model() -> nn.Module:
    """Logits are the two channels' means after BatchNorm: right only when it centres them on the data's means."""
    return nn.Sequential(nn.BatchNorm2d(2, affine=False, momentum=0.01), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def offsets_data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Class 0 lifts channel 0 by 1 and lowers channel 1; class 1 the opposite; both ride on offsets 100 and 50."""
    y = torch.arange(n) % 2
    sign = (1 - 2 * y).float()[:, None, None, None]
    x = torch.tensor([100.0, 50.0])[None, :, None, None] + sign * torch.tensor([1.0, -1.0])[None, :, None, None]
    return x.expand(-1, -1, 4, 4) + 0.1 * torch.randn(n, 2, 4, 4, generator=torch.Generator().manual_seed(0)), y


def test_stale_statistics_are_caught_and_recalibration_makes_eval_mode_match(one_rank: None) -> None:
    model, (x, y) = offsets_model(), offsets_data()
    stale = check_modes(model, x, y)
    assert stale is not None
    assert (stale.eval_accuracy, stale.train_mode_accuracy, stale.images) == (0.5, 1.0, 64)
    assert "far below train-mode accuracy" in stale.warning and "bn_recalibration_batches" in stale.warning
    assert model[0].running_mean.tolist() == [0.0, 0.0]  # the check left the statistics as they were

    loader = list(zip(x.split(16), y.split(16), strict=True))
    assert batchnorm.recalibrate(model, loader, batches=3, device=CPU, autocast=plain) == 48
    batch_means = torch.stack([b.mean(dim=(0, 2, 3)) for b, _ in loader[:3]])
    batch_vars = torch.stack([b.transpose(0, 1).flatten(1).var(dim=1) for b, _ in loader[:3]])
    assert torch.allclose(model[0].running_mean, batch_means.mean(0))
    assert torch.allclose(model[0].running_var, batch_vars.mean(0))
    assert model[0].momentum == 0.01 and model.training

    fixed = check_modes(model, x, y)
    assert fixed is not None and fixed.eval_accuracy == fixed.train_mode_accuracy == 1.0 and fixed.warning == ""


def test_a_model_without_batchnorm_is_left_alone(one_rank: None) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(32, 2))
    x, y = offsets_data()
    assert batchnorm.recalibrate(model, [(x, y)], batches=4, device=CPU, autocast=plain) == 0
    assert check_modes(model, x, y) is None


def _rank_data(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(8, 3, 4, 4, generator=gen) * (rank + 1) + 3 * rank


def _recalibrate_on_ranks(sharded: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.BatchNorm2d(3, momentum=0.01), nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(64, 2))
        if sharded:
            fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        data = _rank_data(dist.get_rank())
        loader = [(batch, torch.zeros(len(batch))) for batch in data.split(4)]
        batchnorm.recalibrate(model, loader, batches=2, device=CPU, autocast=plain)
        every = [batch for rank in (0, 1) for batch in _rank_data(rank).split(4)]
        mean = torch.stack([b.mean(dim=(0, 2, 3)) for b in every]).mean(0)
        var = torch.stack([b.transpose(0, 1).flatten(1).var(dim=1) for b in every]).mean(0)
        bn = model[0]
        assert torch.allclose(bn.running_mean, mean, atol=1e-5), (bn.running_mean, mean)
        assert torch.allclose(bn.running_var, var, atol=1e-4), (bn.running_var, var)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_recalibration_averages_every_ranks_batches(sharded: bool) -> None:
    run_ranks(_recalibrate_on_ranks, sharded)
