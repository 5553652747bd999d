"""Start this node's training ranks with torchrun, wait for them within the time limit, and leave none behind.

A timeout, Ctrl-C or any error here stops torchrun and every rank (:mod:`pipeline.train.launch.procgroup`): killing
torchrun alone leaves its ranks orphaned (docs/prefect.md#task-timeouts-and-torchrun,
docs/torch-distributed.md#workers-outlive-their-agent).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import models
from pipeline import data, host, layout
from pipeline.config import Config, TrainConfig
from pipeline.errors import PipelineError
from pipeline.layout import CONFIG_SNAPSHOT
from pipeline.manifest import RunDir
from pipeline.train.compression import registry
from pipeline.train.launch import procgroup
from pipeline.train.rank import checkpoint, finetune, runtime


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a single-node rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command(
    run_dir: Path,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    max_restarts: int = 0,
    local_addr: str | None = None,
) -> list[str]:
    """The torchrun command line that starts this node's ranks of `pipeline.train.rank.worker`."""
    local = []
    if local_addr:
        # torchrun otherwise advertises the address its hostname resolves to, wrong on hosts with several
        # interfaces, and guesses from the hostname whether it hosts the rendezvous store: say both outright
        # (docs/torch-distributed.md#choosing-the-rendezvous-host).
        hosting = rdzv_endpoint.rsplit(":", 1)[0] == local_addr
        local = ["--local-addr", local_addr, "--rdzv-conf", f"is_host={int(hosting)}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc_per_node),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--max-restarts",
        str(max_restarts),
        *local,
        "-m",
        "pipeline.train.rank.worker",
        "--run-dir",
        str(run_dir),
    ]


def environment(cfg: TrainConfig) -> dict[str, str]:
    """The ranks' environment: ours, plus the settings torchrun and the CPU ranks need."""
    env = dict(os.environ) | cfg.env
    # Restarted ranks otherwise dial a stale rank-0 address from the shared store (pytorch#135712,
    # docs/torch-distributed.md#stale-rendezvous-store-after-restarts).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = str(cfg.threads_per_rank)
    return env


def preflight(cfg: Config) -> None:
    """Reject configs that cannot train before any process starts, so the user gets one line, not N tracebacks."""
    runtime.resolve_backend(cfg.train)
    registry.check(cfg.train)
    data.check_source(cfg.data)
    spec = models.spec_for(cfg.model.name)
    if cfg.data.image_size < spec.min_size:
        raise PipelineError(
            f"data.image_size: {cfg.data.image_size} is below {cfg.model.name}'s minimum input size {spec.min_size}"
        )
    if cfg.model.weights is not None and not cfg.model.weights.is_file():
        raise PipelineError(f"model.weights: {cfg.model.weights}: file not found")
    if cfg.model.weights is not None or cfg.model.freeze != "none":
        # A file that does not fit, or a freeze that leaves nothing to train, is one line here rather than a
        # traceback from every rank. The head may have any class count: a mismatch there is replaced, not an error.
        model = models.build_model(cfg.model.name, 2, spec.channels or data.native_channels(cfg.data))
        if cfg.model.weights is not None:
            models.load_weights(model, cfg.model.name, cfg.model.weights)
        finetune.frozen_names(model, cfg.model.name, cfg.model.freeze)
    train_size = len(data.load(cfg.data, cfg.run.seed, channels=spec.channels).train)
    if cfg.train.batch_size != "auto" and cfg.train.batch_size > train_size:
        raise PipelineError(
            f"train.batch_size: {cfg.train.batch_size} is larger than the training split ({train_size} images of "
            f"data.source {cfg.data.source!r}): one step would be more than the whole epoch"
        )


def local_slots() -> int:
    """How many ranks this node can run: one per GPU, else one per CPU core (more only time-share them)."""
    import torch

    return torch.cuda.device_count() if host.cuda_present() else len(os.sched_getaffinity(0))


def _check_topology(nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    if nproc_per_node < 1:
        raise PipelineError(f"--nproc-per-node: must be at least 1, got {nproc_per_node}")
    if nproc_per_node > (slots := local_slots()):
        where = "GPUs" if host.cuda_present() else "CPU cores"
        raise PipelineError(f"--nproc-per-node: {nproc_per_node} ranks, but this node has {slots} {where}")
    if nnodes < 1:
        raise PipelineError(f"--nnodes: must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise PipelineError(f"--node-rank: must be in [0, {nnodes}), got {node_rank}")
    if nnodes > 1 and not rdzv_endpoint:
        raise PipelineError("--rdzv-endpoint: required when --nnodes > 1 (host:port reachable from every node)")


def _sync_snapshot(cfg: Config, run_dir: Path) -> None:
    """The ranks read the run's config snapshot: make sure it is the config this launch was given."""
    run = RunDir(run_dir)
    if not (run_dir / CONFIG_SNAPSHOT).exists() or run.load_config() != cfg:
        run.save_config(cfg)


def launch(
    cfg: Config,
    run_dir: Path,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    nproc_per_node: int | None = None,
    output: Callable[[str], None] | None = None,
    local_addr: str | None = None,
) -> None:
    """Run torchrun for this node and wait for it, within `train.timeout_s`.

    Single node by default, with a rendezvous on a free loopback port. Several nodes: call this on each with the
    same `nnodes` and `rdzv_endpoint` (host:port of one of them) and its own `node_rank`, and `local_addr` (the
    address the other nodes reach this one at) where the hostname does not resolve to it. Output is inherited, so
    rank 0's progress bar shows live, unless `output` takes it line by line (a Prefect task's logger).
    Raises PipelineError on a non-zero exit or a timeout; torchrun and all
    its ranks are stopped on every way out, Ctrl-C included.
    """
    nproc = cfg.train.nproc_per_node if nproc_per_node is None else nproc_per_node
    _check_topology(nproc, nnodes, node_rank, rdzv_endpoint)
    preflight(cfg)
    run_dir = Path(run_dir).resolve()
    checkpoint.resumable(run_dir / layout.CHECKPOINTS, cfg)  # refuse a foreign checkpoint before touching anything
    _sync_snapshot(cfg, run_dir)
    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    cmd = command(run_dir, nproc, nnodes, node_rank, endpoint, cfg.train.max_restarts, local_addr)
    env = environment(cfg.train)
    if output is not None:
        env["TQDM_MININTERVAL"] = "30"  # a log line per bar redraw: keep redraws rare when output is logged
    job = procgroup.start(cmd, env, output)
    try:
        code = job.proc.wait(timeout=cfg.train.timeout_s)
    except subprocess.TimeoutExpired:
        raise PipelineError(
            f"train.timeout_s: training still running after {cfg.train.timeout_s}s; stopped all its processes"
        ) from None
    finally:
        procgroup.stop(job)  # on every way out; also catches ranks that outlive a torchrun which exited
    if code != 0:
        raise PipelineError(f"train: torchrun exited with code {code}; see output above")
