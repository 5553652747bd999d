"""Which images each rank sees: a shard of the shared splits, or, with each device's own images, a share of its own.

A collective waits for every rank, so every rank must run the same number of steps: with node-local data the
smallest device's share sets everyone's (:func:`samplers`, :func:`train_size_to_plan`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler, Subset

from pipeline.data import Splits
from pipeline.train.rank import runtime
from pipeline.train.rank.runtime import Runtime


class ResumableSampler(Sampler[int]):
    """A DistributedSampler that can start an epoch part-way, after the samples a checkpoint says were done."""

    def __init__(self, inner: DistributedSampler | NodeSampler) -> None:
        self.inner, self.skip = inner, 0

    def __iter__(self) -> Iterator[int]:
        return islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner) - self.skip


class NodeSampler(Sampler[int]):
    """Node-local data (each device its own folder): this rank's share of its device's images, `per_rank` of them
    per epoch, drawn afresh each epoch. `per_rank` is the same on every rank of the job, so every rank runs the same
    number of steps (a collective waits for all); a device with more images contributes a different subset of them
    each epoch."""

    def __init__(self, size: int, per_rank: int, replicas: int, rank: int, seed: int) -> None:
        self.size, self.per_rank, self.replicas, self.rank, self.seed = size, per_rank, replicas, rank, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's images (as DistributedSampler.set_epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=gen)[: self.per_rank * self.replicas]
        return iter(order[self.rank :: self.replicas].tolist())

    def __len__(self) -> int:
        return self.per_rank


def node_samplers(train_size: int, eval_size: int, seed: int, device: torch.device) -> tuple[NodeSampler, ...]:
    """(train, unaugmented-train) samplers over this device's own images, shared among its local ranks."""
    local, replicas = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    fewest = torch.tensor([train_size // replicas, eval_size // replicas], device=device)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)  # the smallest device's share sets every rank's
    train, plain = (int(n) for n in fewest.tolist())
    return NodeSampler(train_size, train, replicas, local, seed), NodeSampler(eval_size, plain, replicas, local, seed)


def train_size_to_plan(own: int, rt: Runtime) -> int:
    """The training split `train.* = "auto"` plans for. With each device's own images, every rank must plan the same
    batch and epochs (or the collectives hang): the smallest device's count, once per device."""
    if not runtime.node_local_data():
        return own
    smallest = torch.tensor([own], device=rt.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item()) * (rt.world_size // int(os.environ["LOCAL_WORLD_SIZE"]))


def samplers(splits: Splits, seed: int, rt: Runtime) -> tuple[DistributedSampler | NodeSampler, ...]:
    """(train, unaugmented-train) samplers of this rank: a shard of the shared splits, or of its device's own."""
    if runtime.node_local_data():
        return node_samplers(len(splits.train), len(splits.train_eval), seed, rt.device)  # type: ignore[arg-type]
    train = DistributedSampler(splits.train, rt.world_size, rt.rank, shuffle=True, seed=seed)
    # Unaugmented training images, as validation sees them: BatchNorm statistics are for eval-time inputs.
    return train, DistributedSampler(splits.train_eval, rt.world_size, rt.rank, seed=seed)


def own_validation(val: Dataset, rt: Runtime) -> Subset:
    """This rank's strided shard of the validation split: every image is counted exactly once across ranks. Each
    device's own images: its ranks share them, and validation counts every device's."""
    shards, shard = rt.world_size, rt.rank
    if runtime.node_local_data():
        shards, shard = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return Subset(val, range(shard, len(val), shards))  # type: ignore[arg-type]
