"""Where and how one rank runs: process group, backend, device, precision and thread count."""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import DataConfig, TrainConfig
from pipeline.errors import PipelineError
from pipeline.train.rank import store

DATA_PATH_ENV = "PIPELINE_DATA_PATH"
"""Set by cluster training on a device the controller sent the dataset to: where that device's copy is."""


def data_config(cfg: DataConfig) -> DataConfig:
    """`data` as this rank reads it: `data.path` is the controller's folder, but a device it was sent to reads its
    own copy (pipeline.train.cluster.nodedata); the config itself stays the controller's, so checkpoints agree on it."""
    where = os.environ.get(DATA_PATH_ENV)
    return cfg.model_copy(update={"path": Path(where)}) if where else cfg


DATA_LOCAL_ENV = "PIPELINE_DATA_LOCAL"
"""Set to 1 by cluster training when each device reads its own `data.path`: the ranks then share their device's
images among themselves instead of taking a global shard of images every device holds."""


def node_local_data() -> bool:
    """True when this device's folder is its own (pipeline.train.cluster.nodedata), not a copy of one every device
    has."""
    return os.environ.get(DATA_LOCAL_ENV) == "1"


@dataclass(frozen=True)
class Runtime:
    """This rank's place in the job and the numeric settings it trains with."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    precision: str
    """Resolved precision: `fp32`, `bf16-mixed` or `fp16-mixed` (never `auto`)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints progress and writes metrics."""
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for forward passes: bf16 or fp16 autocast for the mixed precisions, nothing for fp32."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.precision == "fp16-mixed":
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()


BACKEND_ENV = "PIPELINE_BACKEND"
"""Set by cluster training to the backend every device's ranks use (pipeline.train.cluster.choose_backend)."""


def resolve_backend(cfg: TrainConfig) -> str:
    """The cluster's agreed backend (:data:`BACKEND_ENV`) if any; else `auto` is nccl when CUDA is present and this
    torch has NCCL (NVIDIA's torch for JetPack has not: docs/torch-distributed.md#no-nccl-on-jetson), gloo
    otherwise; an explicit nccl without either is a config error."""
    agreed = os.environ.get(BACKEND_ENV)
    if agreed:
        return agreed
    nccl = dist.is_available() and dist.is_nccl_available()
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() and nccl else "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise PipelineError("train.backend: nccl needs CUDA, which this node does not have (use gloo or auto)")
    if cfg.backend == "nccl" and not nccl:
        raise PipelineError(
            f"train.backend: nccl, but torch {torch.__version__} was built without NCCL (as NVIDIA's torch for "
            "JetPack is); use gloo or auto"
        )
    return cfg.backend


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """`auto` is bf16 autocast only on GPUs with bf16 support: on CPU it buys no speed here
    (docs/torch-distributed.md#fp16-autocast-on-cpu)."""
    if cfg.precision != "auto":
        return cfg.precision
    bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return "bf16-mixed" if bf16_gpu else "fp32"


def local_device(local_rank: int) -> torch.device:
    """The device a rank trains on: GPU `local_rank` where there are GPUs, whichever the backend; else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init(cfg: TrainConfig) -> Runtime:
    """Join the process group torchrun describes in the environment; one GPU per local rank where there are GPUs,
    whichever the backend (a Jetson trains on its GPU with gloo's collectives: docs/torch-distributed.md
    #no-nccl-on-jetson)."""
    backend = resolve_backend(cfg)
    device = local_device(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads_per_rank)
    timeout = datetime.timedelta(seconds=cfg.pg_timeout_s)
    dist.init_process_group(
        backend,
        store=store.ranks_store(timeout),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return Runtime(dist.get_rank(), dist.get_world_size(), backend, device, resolve_precision(cfg, device))
