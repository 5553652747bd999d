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
from dataclasses import replace
from pathlib import Path

import models
from pipeline import data, layout
from pipeline.config import Config, TrainConfig
from pipeline.errors import PipelineError
from pipeline.layout import CONFIG_SNAPSHOT
from pipeline.manifest import RunDir
from pipeline.train.compression import registry
from pipeline.train.launch import procgroup
from pipeline.train.launch.topology import SINGLE_NODE, Topology
from pipeline.train.rank import checkpoint, finetune, runtime


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a single-node rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command(run_dir: Path, topology: Topology, max_restarts: int = 0) -> list[str]:
    """The torchrun command line that starts this node's ranks of `pipeline.train.rank.worker`, `topology` as
    :func:`launch` settles it (its nproc_per_node and rdzv_endpoint set)."""
    assert topology.nproc_per_node is not None and topology.rdzv_endpoint is not None
    local = []
    if local_addr := topology.local_addr:
        # torchrun otherwise advertises the address its hostname resolves to, wrong on hosts with several
        # interfaces, and guesses from the hostname whether it hosts the rendezvous store: say both outright
        # (docs/torch-distributed.md#choosing-the-rendezvous-host).
        hosting = topology.rdzv_endpoint.rsplit(":", 1)[0] == local_addr
        local = ["--local-addr", local_addr, "--rdzv-conf", f"is_host={int(hosting)}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(topology.nproc_per_node),
        "--nnodes",
        str(topology.nnodes),
        "--node-rank",
        str(topology.node_rank),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        topology.rdzv_endpoint,
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


def _sync_snapshot(cfg: Config, run_dir: Path) -> None:
    """The ranks read the run's config snapshot: make sure it is the config this launch was given."""
    run = RunDir(run_dir)
    if not (run_dir / CONFIG_SNAPSHOT).exists() or run.load_config() != cfg:
        run.save_config(cfg)


def launch(
    cfg: Config, run_dir: Path, topology: Topology = SINGLE_NODE, output: Callable[[str], None] | None = None
) -> None:
    """Run torchrun for this node and wait for it, within `train.timeout_s`.

    Single node by default, with a rendezvous on a free loopback port; several nodes: call this on each, with its
    place in the job (:class:`Topology`). Output is inherited, so rank 0's progress bar shows live, unless `output`
    takes it line by line (a Prefect task's logger).
    Raises PipelineError on a non-zero exit or a timeout; torchrun and all
    its ranks are stopped on every way out, Ctrl-C included.
    """
    nproc = topology.check(cfg.train.nproc_per_node)
    preflight(cfg)
    run_dir = Path(run_dir).resolve()
    checkpoint.resumable(run_dir / layout.CHECKPOINTS, cfg)  # refuse a foreign checkpoint before touching anything
    _sync_snapshot(cfg, run_dir)
    endpoint = topology.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    cmd = command(run_dir, replace(topology, nproc_per_node=nproc, rdzv_endpoint=endpoint), cfg.train.max_restarts)
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
