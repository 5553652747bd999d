"""Pieces of one optimizer step that depend on the strategy: gradient scaling, skipping gradient sync between
micro-batches, per-rank augmentation, and the check that all ranks start from the same weights."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from pipeline.train.rank.fsdp2 import FSDPModule
from pipeline.train.rank.runtime import Runtime


def make_scaler(rt: Runtime, model: nn.Module) -> GradScaler:
    """Loss scaling for `fp16-mixed` (a pass-through otherwise).

    Under FSDP each rank sees only its gradient shard, so an overflow must be agreed on by all ranks before one
    skips a step: ShardedGradScaler all-reduces the overflow flag. Under DDP every rank holds the same gradients.
    """
    enabled = rt.precision == "fp16-mixed"
    if isinstance(model, FSDPModule):
        return ShardedGradScaler(rt.device.type, enabled=enabled)
    return GradScaler(rt.device.type, enabled=enabled)


@contextlib.contextmanager
def no_sync(model: nn.Module, skip: bool) -> Iterator[None]:
    """Within, backward passes accumulate gradients locally without communicating (when `skip`)."""
    if not skip:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def augment(x: torch.Tensor, shift: int, seed: int, rank: int, step: int) -> torch.Tensor:
    """Translate the batch by up to `shift` pixels (wrapping around), drawn from a seed of (seed, rank, step).

    A pure function of its arguments: ranks draw different shifts, and a resumed run draws the same ones as an
    uninterrupted run, with no generator state to save.
    """
    if shift == 0:
        return x
    digest = hashlib.sha256(f"{seed}/{rank}/{step}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    dy, dx = torch.randint(-shift, shift + 1, (2,), generator=gen).tolist()
    return torch.roll(x, shifts=(dy, dx), dims=(-2, -1))


def weights_digest(model: nn.Module) -> torch.Tensor:
    """Per-parameter checksums (float64 sums, weighted by position) of a plain, unwrapped model."""
    sums = []
    for p in model.parameters():
        flat = p.detach().double().flatten()
        sums.append((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return torch.stack(sums)


def assert_same_weights(model: nn.Module, device: torch.device) -> None:
    """Fail loudly if ranks built different initial weights (FSDP, unlike DDP, does not broadcast rank 0's)."""
    mine = weights_digest(model).to(device)
    first = mine.clone()
    dist.broadcast(first, src=0)
    if not torch.equal(mine, first):
        raise RuntimeError(f"rank {dist.get_rank()}: initial weights differ from rank 0's")
