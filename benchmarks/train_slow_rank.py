"""One rank at half speed: does it set every step's pace? (issue #31, "slow boards don't set the pace").

    python benchmarks/train_slow_rank.py [--ranks 4] [--epochs 4] [--model mobilenet_v3_small] [--compression diloco]

The digits at 32 px with `--model` (mobilenet_v3_small: most of its step is per image; small_cnn's is nearly all
per-step overhead, which a share cannot move), DDP, `none`, global batch 64, on `--ranks` gloo ranks of this host
(two torchrun nodes meeting on loopback: `pipeline train` starts no more ranks on one node than it has cores), three
runs:

- `equal`: every rank as fast as the others (4 ranks on 2 cores: half a core each);
- `half, equal shares`: the last rank held to half of that (its cgroup's CPU quota: cgroup v2 `cpu.max`, or v1
  `cpu.cfs_quota_us`, over 10 ms periods: tests/harness/cgroup.py), with `train.balance = false`;
- `half, balanced`: the same rank held the same way, at the defaults (`train.balance = true`: each rank's share of
  the batch sized from its measured step, pipeline/train/rank/shares.py).

The quota is applied by moving the rank's process into the cgroup as soon as torchrun has started it (found by its
`RANK` in /proc/<pid>/environ), before its first step. Each run reports the median seconds a step after its first
epoch (shares change at an epoch's end), the final validation accuracy, the batches the ranks ended with and their
last epoch's timings; the step times are against `equal`'s of the same run of this script. The target (issue #31):
`half, balanced` within 1.2x of `equal`, accuracy within a point. The other ranks get the CPU the held one leaves,
so the host keeps its compute: a perfect balance would be 1.0x; what each step costs the held rank whatever its
batch (its optimizer step, the gradients' copies) is the floor.
With `--compression diloco` the same three runs train DiLoCo, whose ranks meet only at its outer steps: the last
is `half, paced` (the held rank trains a share of the steps, shares.paces), and the step time is the mean step's,
outer steps and the waits at them included. Writes benchmarks/results/train_slow_rank.json (or
train_slow_rank_<compression>.json) and prints a table. Root only (the cgroup).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "hooks"))  # benchmark_tables: the table the docs page generates

from benchmark_tables import train_slow_rank as table  # noqa: E402
from pipeline import layout  # noqa: E402
from pipeline.train.compression import registry  # noqa: E402
from tests.harness.cgroup import cpu_quota  # noqa: E402
from tests.train.ranks import free_port  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "train_slow_rank.json"
NODES = 2
"""torchrun nodes on this host, meeting at a rendezvous on loopback: `pipeline train` runs no more ranks on one node
than it has cores (more only time-share them), and here, time-sharing them is the point."""


def rank_pid(rank: int, run_dir: Path) -> int | None:
    """The pid of the training process of `rank` writing into `run_dir`, once torchrun has started it."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"pipeline.train.rank.worker" in cmdline and str(run_dir).encode() in cmdline
        if ours and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def hold(rank: int, run_dir: Path, procs: Path, stop: threading.Event) -> None:
    """Move `rank`'s process into the cgroup whose `cgroup.procs` is `procs`, as soon as it exists."""
    while not stop.is_set():
        pid = rank_pid(rank, run_dir)
        if pid is not None:
            procs.write_text(str(pid))
            return
        time.sleep(0.05)


def train(run_dir: Path, args: argparse.Namespace, balance: bool, procs: Path | None) -> dict[str, Any]:
    """One run; with `procs`, its last rank held in that cgroup."""
    ranks = args.ranks
    cmd = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run_dir)]
    cmd += ["--nnodes", str(NODES), "--nproc-per-node", str(ranks // NODES)]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1"]
    settings = {"model.name": f'"{args.model}"', "data.image_size": args.image_size, "train.epochs": args.epochs}
    settings["train.compression"] = f'"{args.compression}"'
    for key, value in {**settings, "train.balance": str(balance).lower()}.items():
        cmd += ["--set", f"{key}={value}"]
    stop = threading.Event()
    watcher = threading.Thread(target=hold, args=(ranks - 1, run_dir, procs, stop)) if procs else None
    if watcher:
        watcher.start()
    try:
        nodes = [
            subprocess.Popen([*cmd, "--node-rank", str(n)], cwd=ROOT, stdout=subprocess.DEVNULL) for n in range(NODES)
        ]
        if any(node.wait() for node in nodes):
            raise RuntimeError(f"{run_dir.name}: a node failed")
    finally:
        stop.set()
        if watcher:
            watcher.join()
    lines = [json.loads(x) for x in (run_dir / layout.METRICS).read_text().splitlines()]
    steps = [r["batch"] / r["samples_per_s"] for r in lines if "loss" in r and r["epoch"] >= 1]
    epochs_done = [r for r in lines if "val_accuracy" in r]
    return {
        "median_s_per_step": statistics.median(steps),
        "mean_s_per_step": statistics.mean(steps),
        "val_accuracy": epochs_done[-1]["val_accuracy"],
        "batches": epochs_done[-1].get("next_batches"),
        "paces": epochs_done[-1].get("next_paces"),
        "forward_s": epochs_done[-1].get("forward_s"),
        "optimizer_s": epochs_done[-1].get("optimizer_s"),
    }


def main() -> None:
    """Run the three cases, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="mobilenet_v3_small", help="(default mobilenet_v3_small: see above)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--compression", default="none", help="none (shares of the batch) or diloco (of the steps)")
    args = parser.parse_args()
    averages = registry.METHODS[args.compression].after_step is not None
    share = (os.cpu_count() or 1) / args.ranks
    result: dict[str, Any] = {"ranks": args.ranks, "epochs": args.epochs, "cpus": os.cpu_count()}
    result |= {"model": args.model, "image_size": args.image_size, "compression": args.compression}
    result |= {"held_rank": args.ranks - 1, "held_to_cores": share / 2, "rows": []}
    # The ranks of a method that averages models wait for each other only at its averagings: the mean step has them.
    result["measure"] = measure = "mean_s_per_step" if averages else "median_s_per_step"
    with tempfile.TemporaryDirectory() as tmp:
        unequal = "half, paced" if averages else "half, balanced"
        cases = (("equal", True, False), ("half, equal shares", False, True), (unequal, True, True))
        for name, balance, held in cases:
            print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
            run_dir = Path(tmp) / name.replace(", ", "-").replace(" ", "_")
            with cpu_quota(share / 2) if held else contextlib.nullcontext() as procs:
                row = {"case": name, "balance": balance, **train(run_dir, args, balance, procs)}
            result["rows"].append(row)
            print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
    base = result["rows"][0]
    for row in result["rows"]:
        row["vs_equal"] = row[measure] / base[measure]
        row["accuracy_delta"] = row["val_accuracy"] - base["val_accuracy"]
    result["load_average_1m"] = os.getloadavg()[0]
    out = RESULT if args.compression == "none" else RESULT.with_name(f"{RESULT.stem}_{args.compression}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
