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
from pipeline.train.rank import checkpoint, finetune, runtime, store


def command(run_dir: Path, topology: Topology, max_restarts: int = 0) -> list[str]:
    """The torchrun command line that starts this node's ranks of `pipeline.train.rank.worker`, `topology` as
    :func:`launch` settles it (its nproc_per_node, rdzv_endpoint and local_addr set)."""
    assert topology.nproc_per_node is not None and topology.rdzv_endpoint is not None
    assert topology.local_addr is not None
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
        # No agent hosts the store: the launcher of the node at the endpoint does, on that address alone
        # (pipeline/train/rank/store.py). torchrun otherwise advertises the address its hostname resolves to, wrong on
        # hosts with several interfaces: say it outright (docs/torch-distributed.md#choosing-the-rendezvous-host).
        "--rdzv-conf",
        "is_host=0",
        "--local-addr",
        topology.local_addr,
        "--max-restarts",
        str(max_restarts),
        "-m",
        "pipeline.train.rank.worker",
        "--run-dir",
        str(run_dir),
    ]


def environment(cfg: TrainConfig, single_node: bool) -> dict[str, str]:
    """The ranks' environment: ours, plus the settings torchrun and the CPU ranks need."""
    env = dict(os.environ) | cfg.env
    # Restarted ranks otherwise dial a stale rank-0 address from the shared store (pytorch#135712,
    # docs/torch-distributed.md#stale-rendezvous-store-after-restarts).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = str(cfg.threads_per_rank)
    if single_node:
        # gloo listens on the address the hostname resolves to; one host's ranks need loopback only.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def preflight(cfg: Config) -> None:
    """Reject configs that cannot train before any process starts, so the user gets one line, not N tracebacks."""
    runtime.resolve_backend(cfg.train)
    registry.check(cfg.train)
    cfg.train.passed_env()
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
    single = topology.nnodes == 1
    rdzv = topology.rdzv_endpoint or "127.0.0.1:0"
    rdzv_host, _, rdzv_port = rdzv.rpartition(":")
    rdzv_store = store.serve_if_free(rdzv_host, int(rdzv_port))
    if rdzv_store is not None:
        rdzv = f"{rdzv_host}:{rdzv_store.port}"
    local_addr = topology.local_addr or ("127.0.0.1" if single else socket.getfqdn())
    placed = replace(topology, nproc_per_node=nproc, rdzv_endpoint=rdzv, local_addr=local_addr)
    env = environment(cfg.train, single)
    if output is not None:
        env["TQDM_MININTERVAL"] = "30"  # a log line per bar redraw: keep redraws rare when output is logged
    job = procgroup.start(command(run_dir, placed, cfg.train.max_restarts), env, output)
    try:
        code = job.proc.wait(timeout=cfg.train.timeout_s)
    except subprocess.TimeoutExpired:
        raise PipelineError(
            f"train.timeout_s: training still running after {cfg.train.timeout_s}s; stopped all its processes"
        ) from None
    finally:
        procgroup.stop(job)  # on every way out; also catches ranks that outlive a torchrun which exited
        del rdzv_store
    if code != 0:
        raise PipelineError(f"train: torchrun exited with code {code}; see output above")
