"""Samples/s of `pipeline train` against a minimal hand-written DDP loop: same model, data, batch and ranks.

    python benchmarks/train_throughput.py [--epochs 3] [--repeats 2]

Both run under torchrun with 2 gloo ranks on the built-in digits (small_cnn, global batch 64). Samples/s is the
same measure for both: samples of all training steps over the wall time between steps (data loading included,
validation and checkpoints excluded). Writes benchmarks/results/train_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "train_throughput.json"
BATCH, RANKS = 64, 2


def hand_loop(epochs: int, out: Path) -> None:
    """The baseline, run on each rank: DDP, AdamW, DistributedSampler, nothing else."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import models
    from pipeline import data
    from pipeline.config import validate

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    splits = data.load(validate({}, "bench").data, 0, channels=1)
    sampler = DistributedSampler(splits.train, world, rank, shuffle=True, seed=0)
    loader = DataLoader(splits.train, batch_size=BATCH // world, sampler=sampler)
    torch.manual_seed(0)
    model = DistributedDataParallel(models.build_model("small_cnn", 10, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
    samples, seconds = 0, 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        last = time.perf_counter()
        for x, y in loader:
            optim.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optim.step()
            now = time.perf_counter()
            samples, seconds, last = samples + len(x) * world, seconds + now - last, now
    if rank == 0:
        out.write_text(json.dumps({"samples_per_s": samples / seconds}))
    dist.destroy_process_group()


def _torchrun(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--standalone", *args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_hand(epochs: int, tmp: Path) -> float:
    """Samples/s of one hand-written run."""
    out = tmp / "hand.json"
    _torchrun([str(Path(__file__).resolve()), "--hand", str(out), "--epochs", str(epochs)])
    return float(json.loads(out.read_text())["samples_per_s"])


def run_pipeline(epochs: int, tmp: Path, index: int) -> float:
    """Samples/s of one `pipeline train` run (its summary.json)."""
    from pipeline import train
    from pipeline.config import validate
    from pipeline.manifest import create_run_dir, read_json

    cfg = validate({"train": {"epochs": epochs, "batch_size": BATCH, "nproc_per_node": RANKS}}, "bench")
    run = create_run_dir(cfg, tmp / f"run{index}")
    with open(os.devnull, "w") as quiet:
        sys.stderr, saved = quiet, sys.stderr
        try:
            train.run(cfg, run, log=lambda _: None)
        finally:
            sys.stderr = saved
    return float(read_json(run.path / "train" / "summary.json")["samples_per_s"])


def main() -> None:
    """Alternate the two, `repeats` times each, and report medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hand", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand:
        hand_loop(args.epochs, args.hand)
        return
    hand, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            hand.append(run_hand(args.epochs, Path(tmp)))
            ours.append(run_pipeline(args.epochs, Path(tmp), i))
    result = {
        "model": "small_cnn",
        "data": "digits",
        "ranks": RANKS,
        "global_batch": BATCH,
        "epochs": args.epochs,
        "hand_samples_per_s": hand,
        "pipeline_samples_per_s": ours,
        "ratio": statistics.median(ours) / statistics.median(hand),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print("| loop | samples/s (median) |\n|---|---|")
    print(f"| hand-written DDP | {statistics.median(hand):.0f} |")
    print(f"| pipeline train | {statistics.median(ours):.0f} |")
    print(f"ratio pipeline / hand-written: {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
