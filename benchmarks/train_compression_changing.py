"""`compression = "auto"` against every fixed method on a link that changes while training (root only).

    python benchmarks/train_compression_changing.py [--model mobilenet_v3_small] [--epochs 3] [--changes 45,90]

Each method trains the same 2-node job (one rank per node, each node in its own network namespace, as in
benchmarks/train_compression.py) across benchmarks/weaklink.py's link: 100 Mbit/s with 20 ms each way until rank 0's
metrics reach the first step of `--changes`, then 10 Mbit/s (`tc qdisc replace ... tbf`), then unshaped (the tbf
removed; the delay shim stays) from the second. The changes follow steps, not seconds, so every method meets the same
link at the same step. The job's own knobs (batch 32, lr 3e-3, 10 warm-up steps) are the same for every method; `auto`
runs at its defaults (a measurement every 20 steps). Reports each method's training seconds (the sum of its step
times) and final accuracy, auto's total against the best fixed method in hindsight, and a plot of s/step per step with
auto's switches marked. Writes benchmarks/results/train_compression_changing.json and .png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weaklink import WeakLink, _run, unavailable  # noqa: E402
from pipeline.config import toml_value  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("none", "fp16", "powersgd", "topk", "sign", "auto")
PORT = 29400
TRAIN = {
    "batch_size": 32,
    "lr": 3e-3,
    "precision": "fp32",
    "compression_warmup_steps": 10,
    "pg_timeout_s": 600,
}
LINKS = ("100mbit", "10mbit", None)
"""The link of each phase; None: the tbf removed."""


def shape(link: WeakLink, rate: str | None) -> None:
    """Set both ends' tbf to `rate` (tc's units), or remove it."""
    for ns in link.namespaces:
        if rate is None:
            _run("tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root")
        else:
            _run("tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                 "burst", str(2 * (link.mtu + 14)), "latency", f"{link.queue_ms}ms")  # fmt: skip


def steps_done(metrics: Path) -> int:
    """Step lines rank 0 has written so far."""
    if not metrics.exists():
        return 0
    return sum('"loss"' in line for line in metrics.read_text().splitlines())


def follow(link: WeakLink, metrics: Path, changes: list[int], stop: threading.Event) -> None:
    """Change the link when rank 0's metrics reach each step of `changes`."""
    shape(link, LINKS[0])
    for step, rate in zip(changes, LINKS[1:], strict=True):
        while steps_done(metrics) < step and not stop.is_set():
            time.sleep(0.05)
        if stop.is_set():
            return
        shape(link, rate)


def train(method: str, args: argparse.Namespace, run_dir: Path, link: WeakLink) -> None:
    """Run the 2-node job for `method` while the link changes under it."""
    settings: dict[str, Any] = {"model.name": args.model, "data.image_size": 32, "train.epochs": args.epochs}
    settings |= {f"train.{k}": v for k, v in TRAIN.items()} | {"train.compression": method}
    settings["train.env"] = {"GLOO_SOCKET_IFNAME": link.interface}
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={toml_value(value)}")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stop = threading.Event()
    changer = threading.Thread(target=follow, args=(link, run_dir / "train" / "metrics.jsonl", args.changes, stop))
    changer.start()
    procs = []
    try:
        for rank in (0, 1):
            cmd = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run_dir), "--nproc-per-node", "1"]
            cmd += ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"{link.addresses[0]}:{PORT}"]
            cmd += [*sets, "--local-addr", link.addresses[rank]]
            log = (run_dir.parent / f"{method}.node{rank}.log").open("w")
            procs.append(subprocess.Popen(link.argv(rank, cmd), env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait() for p in procs]
    finally:
        stop.set()
        changer.join()
    if codes != [0, 0]:
        raise RuntimeError(f"{method}: nodes exited with {codes}: {run_dir.parent / f'{method}.node0.log'}")


def summarise(method: str, run_dir: Path) -> dict[str, Any]:
    """Per-step seconds, the method of each step, auto's decisions and the final accuracy."""
    lines = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    return {
        "method": method,
        "s_per_step": [r["batch"] / r["samples_per_s"] for r in steps],
        "ran": [r.get("compression") for r in steps],
        "switches": [
            {"step": r["step"], **r["compression_decision"]}
            for r in lines
            if "compression_decision" in r and r["compression_decision"]["switched"]
        ],
        "train_s": sum(r["batch"] / r["samples_per_s"] for r in steps),
        "probe_s": sum(r["compression_decision"].get("probe_s", 0.0) for r in lines if "compression_decision" in r),
        "val_accuracy": summary["val_accuracy"],
        "compression_seconds": summary.get("compression_seconds"),
    }


def plot(rows: list[dict[str, Any]], changes: list[int], path: Path) -> None:
    """s/step against step for every method, the link's phases shaded and auto's switches marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for r in rows:
        width = 2.5 if r["method"] == "auto" else 1.0
        ax.plot(range(1, len(r["s_per_step"]) + 1), r["s_per_step"], label=r["method"], lw=width)
    auto = next((r for r in rows if r["method"] == "auto"), None)
    for s in auto["switches"] if auto else []:
        ax.axvline(s["step"], color="black", ls=":", lw=1)
        ax.annotate(f"→{s['method']}", (s["step"], ax.get_ylim()[1]), rotation=90, va="top", fontsize=8)
    edges = [0, *changes, max(len(r["s_per_step"]) for r in rows)]
    phases = zip(itertools.pairwise(edges), ("100 Mbit/s", "10 Mbit/s", "unshaped"), (0.12, 0.25, 0), strict=True)
    for (lo, hi), name, shade in phases:
        ax.axvspan(lo, hi, color="grey", alpha=shade)
        ax.text((lo + hi) / 2, 0.98, name, transform=ax.get_xaxis_transform(), ha="center", va="top")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("s / step")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    """Parse the arguments, train every method across the changing link, write JSON + PNG, print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--changes", default="45,90", help="steps at which the link goes to 10 Mbit/s, unshaped")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; Δ accuracy against none if run")
    parser.add_argument("--suffix", default="", help="appended to the result files' names")
    args = parser.parse_args()
    args.changes = [int(x) for x in args.changes.split(",")]
    if len(args.changes) != 2:
        parser.error("--changes takes two steps")
    if why := unavailable():
        sys.exit(f"error: {why}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, WeakLink("100mbit", 20.0) as link:
        for method in args.methods.split(","):
            print(f"[{time.strftime('%H:%M:%S')}] {method} ...", file=sys.stderr, flush=True)
            train(method, args, Path(tmp) / method, link)
            rows.append(summarise(method, Path(tmp) / method))
            print(f"  train_s {rows[-1]['train_s']:.1f} acc {rows[-1]['val_accuracy']:.4f}", file=sys.stderr)
    fixed = [r for r in rows if r["method"] != "auto"]
    best = min(fixed, key=lambda r: r["train_s"])
    base = next((r for r in rows if r["method"] == "none"), best)
    for r in rows:
        r["vs_best_fixed"] = r["train_s"] / best["train_s"]
        r["accuracy_delta"] = r["val_accuracy"] - base["val_accuracy"]
    meta = {"model": args.model, "data": "digits @32px", "epochs": args.epochs, "changes_at_step": args.changes}
    meta |= {"links": ["100mbit + 20 ms each way", "10mbit + 20 ms each way", "unshaped + 20 ms each way"]}
    meta |= {"train": TRAIN, "best_fixed": best["method"], "load_average_1m": os.getloadavg()[0]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"train_compression_changing{args.suffix}.json"
    out.write_text(json.dumps({**meta, "methods": rows}, indent=2) + "\n")
    plot(rows, args.changes, RESULTS / f"train_compression_changing{args.suffix}.png")
    print("| method | training s | vs best fixed | val accuracy | Δ vs none |\n|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r['train_s']:.1f}", f"{r['vs_best_fixed']:.2f}x", f"{r['val_accuracy']:.4f}"]
        print(f"| `{r['method']}` | " + " | ".join([*cells, f"{r['accuracy_delta']:+.4f}"]) + " |")


if __name__ == "__main__":
    main()
