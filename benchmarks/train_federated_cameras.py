"""Cameras that train in their idle windows (issue #32): federated training against pooled synchronous DDP.

    python benchmarks/train_federated_cameras.py [--devices 10] [--alpha 0.5] [--rounds 20] [--out PATH.json]

Ten stand-in cameras (tests/harness: a real sshd per device, each in its own namespaces with a private disk; this
venv's Python). Each holds its own share of scikit-learn's 1,797 handwritten digits as PNGs in /opt/edge/digits,
split by a Dirichlet(`--alpha`) label skew (tests/digit_folders.py: some digits common on a camera, others rare or
absent), and is idle in a random 30-70% of every `--period-s` window (its `idle_check`, a shell test on its clock,
with a random phase): the run's rounds meet a changing set of idle cameras.

Runs, each with `pipeline train` as a user runs it, at default knobs but for the model (small_cnn at 8 px, the digits'
own size, no augmentation):

- `ddp`: pooled synchronous DDP, the baseline: one rank per camera, every image in one pool (`data.sync = true`
  sends the controller's folder of all the digits to every device; each rank trains on its shard), `train.epochs`
  at its default. Its bytes are what every rank handed to the gradient all-reduce (rank 0's `comm_bytes` per step,
  times the ranks: each sends the same), at each epoch's validation;
- `federated int8` (the default: FedProx, int8 changes) and `federated fp32` (FedProx, fp32 changes):
  `train.mode = "federated"` over the cameras' own folders, `--rounds` rounds. Their bytes are the model
  sent to each sampled camera plus the changes sent back (metrics.jsonl's `bytes_down` + `bytes_up`), cumulated
  round by round; their accuracy is over every camera's own validation images.

The target is DDP's final accuracy less 2 points (the issue's "within 2 points"); per run, the first evaluation at or
above it gives the bytes (and rounds, epochs, seconds) to reach it, and the ratio to DDP's. The seed's table (bytes
per round, rounds to converge, total) follows from the same numbers: for DDP a "round" is an optimizer step. The
validation sets differ (DDP: a split of the pool; federated: each camera's split of its own share), both a fifth of
the same digits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import layout  # noqa: E402
from tests.digit_folders import write_digit_folders  # noqa: E402
from tests.harness import JetsonFleet, harness_unavailable, network  # noqa: E402
from tests.train.cluster.test_cluster import inventory, pipeline_cmd, start_cluster  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WHERE = "/opt/edge/digits"
COMMON = (
    *("--set", "data.source=imagefolder", "--set", "data.image_size=8", "--set", "data.augment=false"),
    *("--set", "model.name=small_cnn"),
)
RUNS = {
    "federated int8": (),
    "federated fp32": ("--set", "train.federated.delta=fp32"),
}


def idle_check(period_s: int, rng: random.Random) -> tuple[str, float]:
    """A camera's idle check: idle in a random 30-70% of every period, from a random phase."""
    share, phase = rng.uniform(0.3, 0.7), rng.randrange(period_s)
    return f"[ $(( ($(date +%s) + {phase}) % {period_s} )) -lt {round(share * period_s)} ]", share


def train(inv: Path, run_dir: Path, *args: str) -> float:
    """`pipeline train` on the cameras; its wall seconds."""
    started = time.monotonic()
    cmd = pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *COMMON, *args)
    done = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{run_dir.name}: exit {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - started


def ddp_curve(run_dir: Path, ranks: int) -> list[dict[str, Any]]:
    """DDP's validation after each epoch, with the gradient bytes every rank sent until then."""
    sent, steps, curve = 0, 0, []
    for line in (run_dir / layout.METRICS).read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            sent, steps = sent + ranks * int(row.get("comm_bytes") or 0), row["step"]
        elif "val_accuracy" in row:
            curve.append({"epoch": row["epoch"] + 1, "steps": steps, "bytes": sent, "accuracy": row["val_accuracy"]})
    return curve


def federated_curve(run_dir: Path) -> list[dict[str, Any]]:
    """Each round's accuracy with the bytes both ways until then, and who took part."""
    sent, curve = 0, []
    for line in (run_dir / layout.METRICS).read_text().splitlines():
        row = json.loads(line)
        sent += row["bytes_down"] + row["bytes_up"]
        if row.get("val_accuracy") is not None:
            point = {"round": row["round"], "bytes": sent, "accuracy": row["val_accuracy"]}
            curve.append(point | {"took_part": len(row["took_part"]), "not_idle": len(row["not_idle"])})
    return curve


def first_at(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((p for p in curve if p["accuracy"] >= target), None)


def plot(runs: dict[str, dict[str, Any]], target: float, path: Path) -> None:
    """Accuracy against bytes sent, every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        curve = run["curve"]
        ax.plot([max(p["bytes"], 1) / 1e6 for p in curve], [p["accuracy"] for p in curve], marker=".", label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xscale("log")
    ax.set(xlabel="MB sent (all devices, both ways)", ylabel="validation accuracy", ylim=(0, 1))
    ax.set_title("10 cameras, Dirichlet(0.5) label skew, idle 30-70% of the time")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def seed_table(runs: dict[str, dict[str, Any]]) -> str:
    """The seed's table for this project: per-round bytes, rounds to the target, total."""
    lines = ["| run | bytes per round | rounds to target | total to target | vs DDP | final accuracy |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in runs.items():
        reach = run["to_target"]
        rounds = "-" if reach is None else str(reach.get("round", reach.get("steps")))
        total = "never" if reach is None else f"{reach['bytes'] / 1e6:.2f} MB"
        ratio = "-" if run.get("bytes_vs_ddp") is None else f"{run['bytes_vs_ddp']:.3f}x"
        per = f"{run['bytes_per_round'] / 1e6:.3f} MB"
        lines.append(f"| {name} | {per} | {rounds} | {total} | {ratio} | {run['final_accuracy']:.4f} |")
    return "\n".join(lines)


def bench(args: argparse.Namespace, tmp: Path, result: dict[str, Any]) -> None:
    rng = random.Random(args.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(network.ip_forwarding())
        fleet = start_cluster(lambda specs: stack.enter_context(JetsonFleet(tmp / "fleet", specs)), args.devices)
        counts = write_digit_folders([t.disk / "digits" for t in fleet], alpha=args.alpha, seed=args.seed)
        checks = [idle_check(args.period_s, rng) for _ in fleet]
        result["cameras"] = {
            t.name: {"images": sum(c.values()), "per_class": c, "idle_share": round(share, 3)}
            for t, c, (_, share) in zip(fleet, counts, checks, strict=True)
        }
        keys = {t.name.replace("-", "_"): {"idle_check": check} for t, (check, _) in zip(fleet, checks, strict=True)}
        idle_inv = inventory(fleet, tmp / "cameras.toml", **keys)
        plain_inv = inventory(fleet, tmp / "ddp.toml")
        pooled = tmp / "pooled"
        write_digit_folders([pooled], alpha=1000.0)
        runs: dict[str, dict[str, Any]] = {}
        ddp_dir = tmp / "ddp"
        seconds = train(plain_inv, ddp_dir, "--set", f"data.path={json.dumps(str(pooled))}", "--set", "data.sync=true")
        curve = ddp_curve(ddp_dir, args.devices)
        steps = curve[-1]["steps"]
        runs["ddp"] = {"curve": curve, "seconds": round(seconds, 1), "bytes_per_round": curve[-1]["bytes"] / steps}
        for name, extra in RUNS.items():
            run_dir = tmp / name.replace(" ", "-")
            fed = ("--set", "train.mode=federated", "--set", f"train.federated.rounds={args.rounds}")
            seconds = train(idle_inv, run_dir, *fed, "--set", f"data.path={json.dumps(WHERE)}", *extra)
            curve = federated_curve(run_dir)
            per = curve[-1]["bytes"] / len((run_dir / layout.METRICS).read_text().splitlines())
            runs[name] = {"curve": curve, "seconds": round(seconds, 1), "bytes_per_round": per}
            print(f"{name}: final {curve[-1]['accuracy']:.4f} in {seconds:.0f}s", file=sys.stderr)
    target = runs["ddp"]["curve"][-1]["accuracy"] - 0.02
    ddp_reach = first_at(runs["ddp"]["curve"], target)
    for run in runs.values():
        run["final_accuracy"] = run["curve"][-1]["accuracy"]
        run["to_target"] = first_at(run["curve"], target)
        if run["to_target"] is not None and ddp_reach is not None:
            run["bytes_vs_ddp"] = round(run["to_target"]["bytes"] / ddp_reach["bytes"], 4)
    result |= {"target_accuracy": target, "runs": runs}
    best = runs["federated int8"]
    result["verdict"] = {
        "within_2_points": best["final_accuracy"] >= target,
        "bytes_vs_ddp": best.get("bytes_vs_ddp"),
        "met": best["final_accuracy"] >= target and (best.get("bytes_vs_ddp") or 1.0) <= 0.1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew (default 0.5)")
    parser.add_argument("--rounds", type=int, default=20, help="federated rounds (default 20, the default)")
    parser.add_argument("--period-s", type=int, default=60, help="each camera's idle window repeats this often")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "train_federated_cameras.json")
    args = parser.parse_args()
    if why := harness_unavailable(network=True):
        sys.exit(f"error: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the with-blocks still tear everything down
    result: dict[str, Any] = {"devices": args.devices, "alpha": args.alpha, "rounds": args.rounds}
    result |= {"period_s": args.period_s, "model": "small_cnn", "image_size": 8, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp), result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "load_average_1m": os.getloadavg()[0]}, indent=2) + "\n")
    plot(result["runs"], result["target_accuracy"], args.out.with_suffix(".png"))
    print(seed_table(result["runs"]))
    print(f"target {result['target_accuracy']:.4f}: {result['verdict']}")


if __name__ == "__main__":
    main()
