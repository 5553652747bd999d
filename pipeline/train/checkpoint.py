"""Epoch checkpoints in torch.distributed.checkpoint (DCP) format, the ``latest`` pointer, pruning and resume.

Layout, which the consolidate stage reads::

    train/checkpoints/step-<N>/   DCP checkpoint of {"model": ..., "optim": ...} from ``get_state_dict``
                                  (plain model keys, no "module." prefix, the same under DDP and FSDP),
                                  rng-<rank>.pt (each rank's torch RNG state) and trainer.json (epoch, step,
                                  the position in an unfinished epoch, the gradient scaler's state)
    train/checkpoints/latest      relative symlink -> step-<N>, repointed only once step-<N> is complete

Every rank calls :func:`save` and :func:`load` (they are collectives); only rank 0 touches the pointer and prunes.
On several nodes, ``checkpoints/`` must be on a filesystem they share: each rank writes its own shard.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.manifest import read_json, write_json

TRAINER_JSON = "trainer.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, newest (highest step) first."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def latest(root: Path) -> Path | None:
    """The step directory `latest` points to, or None when there is no checkpoint yet."""
    pointer = root / LATEST
    if not pointer.is_symlink():
        return None
    target = pointer.resolve()
    if not (target / TRAINER_JSON).is_file():
        raise PipelineError(f"{pointer}: points to {target.name}, which is missing or incomplete")
    return target


def read_meta(step_dir: Path) -> dict[str, Any]:
    """trainer.json of a complete checkpoint: at least `epoch` (last finished, 0-based) and `step`."""
    return read_json(step_dir / TRAINER_JSON)


def resume_key(cfg: Config) -> str:
    """What a checkpoint must have been trained on to be resumed: the same data and model config."""
    return cfg.digest("data", "model")


def resumable(root: Path, cfg: Config) -> Path | None:
    """The `latest` checkpoint when `cfg` may resume it, None when there is none; another config's is an error."""
    found = latest(root)
    if found is not None and read_meta(found).get("resume_key") != resume_key(cfg):
        raise PipelineError(f"{found}: written for a different data/model config; train into a new run directory")
    return found


def _point_latest(root: Path, name: str) -> None:
    """Repoint `latest` with one rename, so a reader sees the old or the new checkpoint, never neither."""
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, root / LATEST)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest step directories, never the one `latest` points to; return the deleted."""
    current = (root / LATEST).resolve() if (root / LATEST).is_symlink() else None
    doomed = [p for p in step_dirs(root)[keep:] if p.resolve() != current]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _state(model: nn.Module, optim: Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def save(root: Path, model: nn.Module, optim: Optimizer, meta: dict[str, Any], keep: int) -> Path:
    """Write `step-<meta["step"]>/` on all ranks, then (rank 0) trainer.json, repoint `latest`, prune to `keep`."""
    target = root / f"step-{meta['step']}"
    if dist.get_rank() == 0:
        # A crash after a previous save of this step (resumed from an older one) leaves stale shards behind.
        assert latest(root) != target.resolve(), f"{target} is the live checkpoint"
        shutil.rmtree(target, ignore_errors=True)
    dist.barrier()
    # dcp.save returns on rank 0 only after every rank's shard is written and the metadata is saved.
    dcp.save(_state(model, optim), checkpoint_id=target)
    torch.save(torch.get_rng_state(), target / f"rng-{dist.get_rank()}.pt")
    dist.barrier()  # every rank's RNG file is on disk before the checkpoint is declared complete
    if dist.get_rank() == 0:
        write_json(target / TRAINER_JSON, meta)
        _point_latest(root, target.name)
        prune(root, keep)
    dist.barrier()
    return target


def load(step_dir: Path, model: nn.Module, optim: Optimizer) -> dict[str, Any]:
    """Restore model and optimizer from a complete checkpoint on all ranks; return its trainer.json."""
    meta = read_meta(step_dir)
    state = _state(model, optim)
    dcp.load(state, checkpoint_id=step_dir)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = step_dir / f"rng-{dist.get_rank()}.pt"
    if rng.is_file():  # absent when the world grew: such a rank keeps its own seed
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return meta
