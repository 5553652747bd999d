"""Epoch checkpoints in torch.distributed.checkpoint (DCP) format, the ``latest`` pointer, pruning and resume.

Layout, which the consolidate stage reads::

    train/checkpoints/step-<N>/   DCP checkpoint of {"model": ..., "optim": ...} from ``get_state_dict``
                                  (plain model keys, no "module." prefix, the same under DDP and FSDP),
                                  and "outer": DiLoCo's outer momentum (trainer.json's `outer_state`),
                                  rng-<rank>.pt (each rank's torch RNG state) and trainer.json (epoch, step,
                                  the position in an unfinished epoch, the gradient scaler's state)
    train/checkpoints/latest      relative symlink -> step-<N>, repointed only once step-<N> is complete

Every rank calls :meth:`Checkpointer.save` and :func:`load` (they are collectives); only rank 0 touches the pointer
and prunes.
On several nodes, ``checkpoints/`` must be on a filesystem they share: each rank writes its own shard. Cluster
training over SSH is the exception (``PIPELINE_CHECKPOINT_PER_NODE``): each device has a disk of its own, and under
DDP, where every rank holds the whole state, each device writes a whole checkpoint of its own, its first rank taking
rank 0's part, so that no single device's loss takes the newest checkpoint with it.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
import shutil
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from pipeline import safe_dcp
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import atomic_path, first_line, fsync_dir, read_json, write_json

TRAINER_JSON = "trainer.json"
PER_NODE_ENV = "PIPELINE_CHECKPOINT_PER_NODE"
"""Set to 1 by cluster training over SSH, where each device's run directory is on its own disk: under DDP, each
device then writes a whole checkpoint (:class:`Checkpointer`'s `per_node`)."""
LATEST = "latest"
RNG_PREFIX = "rng-"
"""Each rank's RNG state is `rng-<rank>.pt` in the checkpoint, written whole (by a rename) before its save starts."""
_STEP_DIR = re.compile(r"step-(\d+)")
# What a checkpoint's own files are called (__0_0.distcp, .metadata, trainer.json, rng-0.pt, SHA256SUMS): a name
# from elsewhere (a device, a .metadata) outside this set could climb out of the directory it is joined to.
_PLAIN_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]{1,128}")


def plain_name(name: str) -> bool:
    """True when `name` can be a file of a checkpoint directory: letters, digits, `._-`, not `.` or `..`, at most
    128 characters; joined to a directory, it names a file directly inside it."""
    return _PLAIN_NAME.fullmatch(name) is not None


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
    meta = read_json(step_dir / TRAINER_JSON)
    if not isinstance(meta, dict) or not all(isinstance(meta.get(key), int) for key in ("epoch", "step")):
        raise PipelineError(f"{step_dir / TRAINER_JSON}: corrupt: needs an object with integer epoch and step")
    return meta


def resume_key(cfg: Config) -> str:
    """What a checkpoint must have been trained on to be resumed: the same data and model config."""
    return cfg.digest("data", "model")


def resumable(root: Path, cfg: Config) -> Path | None:
    """The `latest` checkpoint when `cfg` may resume it, None when there is none; another config's is an error."""
    found = latest(root)
    if found is None:
        return None
    if read_meta(found).get("resume_key") != resume_key(cfg):
        raise PipelineError(f"{found}: written for a different data/model config; train into a new run directory")
    # Refused here, once, before any rank starts, rather than as a traceback on every rank.
    safe_dcp.read_metadata(found)
    for rng in sorted(found.glob(f"{RNG_PREFIX}*.pt")):
        _check_rng(rng)
    return found


def _check_rng(path: Path) -> None:
    """A one-line error unless `path` holds a torch RNG state (a byte tensor) that `weights_only` loads."""
    try:
        state = torch.load(path, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError, OSError, ValueError) as err:
        why = first_line(err, typed=True)
    else:
        if isinstance(state, torch.Tensor) and state.dtype == torch.uint8:
            return
        why = f"holds a {type(state).__name__}, not an RNG state"
    raise PipelineError(
        f"{path}: unreadable ({why}); delete it to resume with that rank's own seed, or train into a new run directory"
    )


def point_latest(root: Path, name: str) -> None:
    """Repoint `latest` with one rename, so a reader sees the old or the new checkpoint, never neither."""
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, root / LATEST)
    fsync_dir(root)  # the commit point of a checkpoint: durable before training goes on


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest step directories, never the one `latest` points to; return the deleted."""
    current = (root / LATEST).resolve() if (root / LATEST).is_symlink() else None
    doomed = [p for p in step_dirs(root)[keep:] if p.resolve() != current]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def _state(model: nn.Module, optim: Optimizer, outer: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd} | ({"outer": outer} if outer else {})


def per_node(strategy: str) -> bool:
    """Whether each node saves a whole checkpoint of its own (:class:`Checkpointer`'s `per_node`): in cluster training
    over SSH (:data:`PER_NODE_ENV`), under DDP."""
    return os.environ.get(PER_NODE_ENV) == "1" and strategy == "ddp"


def node_group() -> dist.ProcessGroup:
    """A gloo group of this node's ranks (torchrun's `GROUP_RANK`); every rank calls it, once. Each rank learns the
    others' nodes from one all-gather; only a node's own ranks then meet to make its group."""
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"))
    mine = [rank for rank, node in enumerate(nodes) if node == nodes[dist.get_rank()]]
    return dist.new_group(mine, backend="gloo", use_local_synchronization=True)


def background(setting: bool | None, device: torch.device, across_nodes: bool) -> bool:
    """Whether saves run in the background: as `setting` says, else when training on CUDA or across nodes.

    On CPU ranks that use every core of one node, a writer thread takes turns with training. Measured with 2 ranks
    on 2 cores, whole runs took longer in the background: small_cnn 0.82-0.95 s against 0.72-0.79 s, resnet18
    10.4-10.8 s against 9.9 s. Across nodes a save waits on the link for its dozen collectives instead
    (docs/measurements.md#background-checkpoints-on-cpu); a save of each node's own (:class:`Checkpointer`'s
    `per_node`) has none, and the caller does not count it as across nodes.
    """
    return (device.type == "cuda" or across_nodes) if setting is None else setting


class Checkpointer:
    """Writes this rank's checkpoints, in the foreground or in the background, with at most one save in flight.

    In the background (`asynchronous`), :meth:`save` copies the state to CPU memory and returns while a thread
    writes it with ``dcp.async_save`` over a gloo group of its own: on the default group its collectives would
    interleave with training's and deadlock (docs/torch-distributed.md#async-checkpoints-need-their-own-group).
    The group's rank 0 alone commits a save (trainer.json, `latest`, pruning) once its own write has completed, which
    DCP makes happen only after every rank's shard is written; each rank's RNG file is written before its write
    starts. Every rank calls :meth:`save` and :meth:`wait` at the same points; :meth:`poll` (each step) and
    :meth:`settle` (on the way out after an error) are local.

    `per_node` (replicated state only: DDP): the ranks meet on a group of this node's ranks, and its first rank
    writes the whole state alone, with no process group at all (:func:`_save_alone`), and commits it under the
    node's own `root`: the save of a device that is lost takes no other device's with it, and costs no round over the
    link.
    """

    def __init__(self, root: Path, keep: int, asynchronous: bool, per_node: bool = False) -> None:
        self.root, self.keep, self.asynchronous, self.per_node = root, keep, asynchronous, per_node
        self.group = node_group() if per_node else dist.new_group(backend="gloo") if asynchronous else None
        # What the ranks meet on: a background save's group is the default group's ranks; a node's, its own.
        self.members = self.group if per_node else None
        self.lead = dist.get_rank(self.members) == 0
        self._pending: tuple[Future[Any], Path, dict[str, Any]] | None = None

    def save(
        self, model: nn.Module, optim: Optimizer, meta: dict[str, Any], outer: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Checkpoint step `meta["step"]` into `step-<N>/` on all ranks, with the compression's `outer` state if
        any (recorded as `outer_state` in trainer.json); returns before it is written when asynchronous, after it is
        committed otherwise."""
        meta = meta | {"outer_state": bool(outer)}
        if self.asynchronous:  # a foreground save was committed, and the ranks met, before it returned
            self.wait()  # the previous save is committed before the next one starts
        target = self.root / f"step-{meta['step']}"
        if self.lead:
            # A crash after a previous save of this step (resumed from an older one) leaves stale shards behind.
            assert latest(self.root) != target.resolve(), f"{target} is the live checkpoint"
            shutil.rmtree(target, ignore_errors=True)
        dist.barrier(group=self.members)
        target.mkdir(parents=True, exist_ok=True)
        # Durable and whole, or absent: an emptied rng file (a power cut after an in-place write) fails every resume.
        with atomic_path(target / f"{RNG_PREFIX}{dist.get_rank()}.pt") as tmp:
            torch.save(torch.get_rng_state(), tmp)
        state = _state(model, optim, outer)
        # Every replicated tensor (all of DDP's) in the lead rank's file: a checkpoint is then whole without the files
        # of the other ranks, so one that leaves after the save does not take the newest checkpoint with it.
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        written: Future[Any]
        if self.per_node:
            written = _save_alone(state, target, self.asynchronous) if self.lead else _done()
        elif self.asynchronous:
            written = dcp.async_save(state, checkpoint_id=target, process_group=self.group, planner=planner)
        else:
            written = _done(dcp.save(state, checkpoint_id=target, process_group=self.group, planner=planner))
        self._pending = (written, target, meta)
        if not self.asynchronous:
            self.wait()
        return target

    def poll(self) -> None:
        """Commit the save in flight if its write has completed (a no-op but on the lead rank); never blocks."""
        if self._pending is not None and self._pending[0].done():
            self._commit_pending()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed; raises if writing it failed."""
        if self._pending is not None:
            self._commit_pending()
        dist.barrier(group=self.members)  # no rank reads `latest` before the lead rank has moved it

    def settle(self, timeout_s: float) -> None:
        """After an error: give the save in flight up to `timeout_s` to finish and commit it if it did. No
        collectives (peers may be gone) and no exceptions: `latest` then stays on the last committed save."""
        if self._pending is None:
            return
        written, target, _ = self._pending
        try:
            written.result(timeout=timeout_s)
            self._commit_pending()
        except Exception as err:
            self._pending = None
            print(f"rank {dist.get_rank()}: {target.name} not committed: {err!r}", file=sys.stderr)

    def _commit_pending(self) -> None:
        assert self._pending is not None
        written, target, meta = self._pending
        self._pending = None
        written.result()
        if self.lead:
            write_json(target / TRAINER_JSON, meta)
            point_latest(self.root, target.name)
            prune(self.root, self.keep)


def _save_alone(state: dict[str, Any], target: Path, asynchronous: bool) -> Future[Any]:
    """Write the whole `state` from this rank alone: DCP with no process group, so no collective and no coordinator
    but itself. torch 2.5 (JetPack 6) has `no_dist` only on the older `save_state_dict`, and no background form of it
    (docs/torch-distributed.md#dcp-spreads-replicated-tensors-over-the-ranks)."""
    with warnings.catch_warnings():
        # "assuming the intent is to save in a single process": it is; and "deprecated": torch 2.5's only way to it.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        if "no_dist" not in inspect.signature(dcp.save).parameters:
            return _done(dcp.save_state_dict(state, storage_writer=dcp.FileSystemWriter(target), no_dist=True))
        if asynchronous:
            return dcp.async_save(state, checkpoint_id=target, no_dist=True)
        return _done(dcp.save(state, checkpoint_id=target, no_dist=True))


def _done(result: Any = None) -> Future[Any]:
    written: Future[Any] = Future()
    written.set_result(result)
    return written


def load(
    step_dir: Path, model: nn.Module, optim: Optimizer, outer: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Restore model and optimizer from a complete checkpoint on all ranks, and the compression's `outer` state in
    place where the checkpoint has one (trainer.json's `outer_state`); return its trainer.json."""
    meta = read_meta(step_dir)
    state = _state(model, optim, outer if meta.get("outer_state") else None)
    safe_dcp.load(state, step_dir)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = step_dir / f"{RNG_PREFIX}{dist.get_rank()}.pt"
    if rng.is_file():  # absent when the world grew: such a rank keeps its own seed
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return meta
