"""A device's self-test before training is trusted to it (`pipeline cluster check --deep`): the process-group backend
the job would use, with one peer, and one training step of the configured model on the device's own accelerator,
each timed. Prints one line, ``SELFTEST {json}``.

Run on the device by the controller over SSH, with the job's config beside it:

    python -m pipeline.train.rank.selftest --run-dir DIR --backend gloo --ranks 4

The peer is a second process on the same device, over loopback only (its store is served on 127.0.0.1 alone, gloo's
links on `lo`): what is tested is the device's torch, its backend on the tensors it trains with (a Jetson's GPU under
gloo: docs/torch-distributed.md#no-nccl-on-jetson), not the network. A device with one GPU cannot host two nccl ranks,
so there the collective is left to the first training round, and the report says so. The installed release's
inference is the controller's other question to the device (pipeline.deploy.health, run after this).

A device imports this module (Python 3.10, torch 2.5).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from pipeline.errors import PipelineError
from pipeline.files import first_line
from pipeline.manifest import RunDir
from pipeline.train.compression import collectives
from pipeline.train.rank import plan, runtime, store

ELEMENTS = 1 << 20
"""Entries of the all-reduced tensor (4 MB of fp32: big enough to take a measurable time, small for any board)."""
TIMEOUT_S = 120


def main(argv: list[str] | None = None) -> int:
    """Entry point on the device; prints ``SELFTEST {json}`` (each part's result, or why it failed) and exits 0."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.train.rank.selftest", description=__doc__)
    parser.add_argument("--run-dir", type=Path, help="directory holding the job's config.json")
    parser.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    parser.add_argument("--ranks", type=int, default=1, help="ranks of the whole job (sets the batch per rank)")
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)  # the peer process: the store's port
    args = parser.parse_args(argv)
    if args.peer is not None:
        _all_reduce(args.backend, rank=1, port=args.peer)
        return 0
    report = {"backend": _collective(args.backend), "train_step": _guarded(_train_step, args.run_dir, args.ranks)}
    print("SELFTEST " + json.dumps(report), flush=True)
    return 0


def _collective(backend: str) -> dict[str, Any]:
    """One all-reduce between this process and a peer process on the device, on the training device's tensors."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        return {"ok": True, "backend": backend, "skipped": "one GPU: nccl cannot put two ranks on it"}
    server = store.serve("127.0.0.1", world_size=None, timeout_s=TIMEOUT_S)
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    peer_args = [sys.executable, "-m", "pipeline.train.rank.selftest", "--backend", backend, "--peer", str(server.port)]
    peer = subprocess.Popen(peer_args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        result = _guarded(_all_reduce, backend, 0, server.port, server)
        _, err = peer.communicate(timeout=TIMEOUT_S)
        if peer.returncode != 0 and result.get("ok"):
            last = err.strip().splitlines()[-1] if err.strip() else f"exit status {peer.returncode}"
            result = {"ok": False, "reason": f"the peer process failed: {last}"}
    finally:
        if peer.poll() is None:
            peer.kill()
    return {"backend": backend, **result}


def _all_reduce(backend: str, rank: int, port: int, server: dist.Store | None = None) -> dict[str, Any]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    kv = server or dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=kv, rank=rank, world_size=2, timeout=timeout)
    try:
        # The peer shares the device's one GPU where it has only one (gloo allows it).
        device = runtime.local_device(rank % max(torch.cuda.device_count(), 1))
        tensor = torch.full((ELEMENTS,), float(rank + 1), device=device)
        dist.all_reduce(tensor)  # the first one sets up the links
        started = time.perf_counter()
        dist.all_reduce(tensor)
        collectives.synchronize(tensor.device)
        seconds = time.perf_counter() - started
        ok = bool((tensor == 6.0).all())  # (1 + 2) summed twice
        return {"ok": ok, "device": str(tensor.device), "seconds": round(seconds, 6)} | (
            {} if ok else {"reason": "the all-reduce gave a wrong sum"}
        )
    finally:
        dist.destroy_process_group()


def _train_step(run_dir: Path | None, ranks: int) -> dict[str, Any]:
    """One forward, backward and AdamW step of the config's model on a batch of its size, at its precision."""
    if run_dir is None:
        raise PipelineError("--run-dir: needed for the training step")
    cfg = RunDir(run_dir).load_config()
    device = runtime.local_device(0)
    spec = models.spec_for(cfg.model.name)
    size = max(cfg.data.image_size, spec.min_size)
    global_batch = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else plan.BATCH
    batch = max(1, global_batch // max(ranks, 1))
    net = models.build_model(cfg.model.name, 10, spec.channels or 3).to(device)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3)
    precision = runtime.resolve_precision(cfg.train, device)
    rt = runtime.Runtime(0, 1, "none", device, precision)
    x = torch.randn(batch, spec.channels or 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    seconds = []
    for _ in range(2):  # the first step pays for allocation and kernel selection
        started = time.perf_counter()
        with rt.autocast():
            loss = F.cross_entropy(net(x).float(), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        collectives.synchronize(device)
        seconds.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finite = bool(torch.isfinite(loss).item())
    result = {"ok": finite, "model": cfg.model.name, "batch": batch, "image_size": size, "device": str(device)}
    result |= {"precision": precision, "seconds": round(seconds[-1], 6), "peak_bytes": peak}
    return result | ({} if finite else {"reason": "the loss is not finite"})


def _guarded(part: Any, *args: Any) -> dict[str, Any]:
    """`part(*args)`, or why it failed: a device's failure is the report, not a crash of the self-test."""
    try:
        return part(*args)
    except Exception as err:
        return {"ok": False, "reason": first_line(err, typed=True)}


if __name__ == "__main__":
    sys.exit(main())
