"""How the model is spread over the ranks. Today: DDP with a compression hook; FSDP and `auto` slot in here."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.config import TrainConfig
from pipeline.train import compression
from pipeline.train.compression import CommCounter
from pipeline.train.runtime import Runtime


def wrap(model: nn.Module, cfg: TrainConfig, rt: Runtime) -> tuple[nn.Module, CommCounter]:
    """Move `model` to this rank's device and wrap it for data parallelism; return it and its byte counter."""
    model = model.to(rt.device)
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    return ddp, compression.install(ddp, cfg.compression)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside the wrapper: for evaluation, whose forward must not run collectives."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def sync_buffers(model: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank.

    DDP broadcasts them at the start of each forward, but every rank then updates its own copy with its own
    batch; syncing before evaluation and checkpoints makes all ranks evaluate and save the same model.
    """
    for buf in unwrap(model).buffers():
        dist.broadcast(buf, src=0)
