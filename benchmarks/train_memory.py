"""Per-rank memory under DDP and FSDP2: parameters, gradients, optimizer state, and peak RSS.

    python benchmarks/train_memory.py [--model resnet18] [--steps 3]

Two gloo ranks per strategy, each in fresh processes (peak RSS is per process), AdamW, random 32 px images.
glibc's allocator keeps freed memory and hides the difference in RSS; MALLOC_MMAP_THRESHOLD_=65536 returns large
blocks to the system. Writes benchmarks/results/train_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "train_memory.json"
RANKS, BATCH = 2, 16


def _local_bytes(tensors: list) -> int:
    # numel, not storage size: FSDP's gradient shards are views into one reduce-scatter buffer.
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _rank(rank: int, name: str, model_name: str, steps: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import models
    from pipeline.config import validate
    from pipeline.train.rank import runtime, strategy

    cfg = validate({"train": {"strategy": name, "precision": "fp32"}}, "bench").train
    rt = runtime.init(cfg)
    torch.manual_seed(0)
    model, _ = strategy.wrap(models.build_model(model_name, 10, 3), cfg, rt, name)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optim.zero_grad(set_to_none=False)
        F.cross_entropy(model(torch.randn(BATCH, 3, 32, 32)), torch.randint(0, 10, (BATCH,))).backward()
        optim.step()
    params = list(model.parameters())
    state = [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    row = {
        "params_mb": _local_bytes(params) / 2**20,
        "grads_mb": _local_bytes([p.grad for p in params if p.grad is not None]) / 2**20,
        "optimizer_mb": _local_bytes(state) / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / f"{name}.{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def measure(name: str, model_name: str, steps: int, out: Path) -> dict[str, float]:
    """Rank 0's numbers and the larger peak RSS of the two ranks."""
    import torch.multiprocessing as mp

    from pipeline.train.launch.launcher import free_port

    mp.start_processes(_rank, (name, model_name, steps, free_port(), out), nprocs=RANKS, start_method="spawn")
    rows = [json.loads((out / f"{name}.{r}.json").read_text()) for r in range(RANKS)]
    return {**rows[0], "peak_rss_mb": max(r["peak_rss_mb"] for r in rows)}


def main() -> None:
    """Measure DDP then FSDP and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: measure(name, args.model, args.steps, Path(tmp)) for name in ("ddp", "fsdp")}
    meta = {"model": args.model, "ranks": RANKS, "batch_per_rank": BATCH, "optimizer": "AdamW"}
    meta["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_MMAP_THRESHOLD_"]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    print("| per rank (MiB) | parameters | gradients | optimizer state | peak RSS |\n|---|---|---|---|---|")
    for name, r in result.items():
        cells = " | ".join(f"{r[k]:.1f}" for k in ("params_mb", "grads_mb", "optimizer_mb", "peak_rss_mb"))
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
