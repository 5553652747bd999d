"""s/step, bytes/step and final accuracy of every gradient-compression method, for resnet18 across a weak link.

    python benchmarks/train_compression.py [--link weak|loopback] [--epochs 3] [--seed 0] [--methods none,...]
                                           [--suffix _name]

Every `train.compression` value, `auto` included, and `localsgd_int8` (`localsgd` with `train.localsgd_int8`)
trains resnet18 on the built-in digits (32 px, global batch 32, lr 3e-3, 3 epochs, seed 0; every other compression
knob at its default, so the first epoch is the warm-up) as one 2-node job of
`pipeline train --nnodes 2`, one rank per node. `--link weak` (the default, root only) puts node 0 and node 1 in two
network namespaces joined by a veth limited to 100 Mbit/s with 20 ms added each way (benchmarks/weaklink.py); `--link
loopback` runs both nodes on 127.0.0.1, unshaped. Per method: the mean wall time of the steps after the first epoch
(local SGD's periodic averaging steps included), the mean `comm_bytes` of those steps, and the final validation
accuracy; the speed-up is against `none` of the same run. Writes benchmarks/results/train_compression[_loopback].json
and .png (`_seedN` added for a seed other than 0: `run.seed` also draws the validation split; then `--suffix`), and
prints a table.
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
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weaklink import WeakLink, unavailable  # noqa: E402
from pipeline.config import toml_value  # noqa: E402
from pipeline.train.compression import registry  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = {"localsgd_int8": ("localsgd", {"train.localsgd_int8": True})}
"""Rows that are one `train.compression` with a knob set: name -> (method, settings)."""
METHODS = (*registry.METHODS, *VARIANTS)
PORT = 29400
TRAIN = {"batch_size": 32, "lr": 3e-3, "precision": "fp32", "pg_timeout_s": 600}
"""The job's settings; every compression knob (warm-up, rank, fraction, period, auto's) stays at its default."""


def cpu_facts() -> dict[str, Any]:
    """The CPU model and whether it has AVX-512: resnet18's step took 0.15 s on one machine of this workplace and
    0.49 s on another (AVX2 only), which moves every compressed method's ratio to the link-bound `none`."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return {"cpu_model": model, "avx512": " avx512f" in info}


def overrides(method: str, epochs: int, interface: str | None, seed: int = 0) -> list[str]:
    """`--set` arguments of one method's config: the same for every method but `train.compression`."""
    settings: dict[str, Any] = {"model.name": "resnet18", "data.image_size": 32, "train.epochs": epochs}
    settings["run.seed"] = seed
    compression, knobs = VARIANTS.get(method, (method, {}))
    settings |= {f"train.{k}": v for k, v in TRAIN.items()} | {"train.compression": compression} | knobs
    if interface is not None:  # the one interface each namespace has: gloo must not guess from the hostname
        settings["train.env"] = {"GLOO_SOCKET_IFNAME": interface}
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={toml_value(value)}")]


def node_command(
    method: str, epochs: int, run_dir: Path, rank: int, link: WeakLink | None, port: int, seed: int = 0
) -> list[str]:
    """`pipeline train` for node `rank` of the job, inside its namespace when there is a link."""
    host = link.addresses[0] if link else "127.0.0.1"
    cmd = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run_dir), "--nproc-per-node", "1"]
    cmd += ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"{host}:{port}"]
    cmd += overrides(method, epochs, link.interface if link else None, seed)
    if link is None:
        return cmd
    # The hostname resolves to no address inside a namespace: each node says where the other reaches it.
    return link.argv(rank, [*cmd, "--local-addr", link.addresses[rank]])


def train_nodes(method: str, epochs: int, run_dir: Path, link: WeakLink | None, seed: int = 0) -> float:
    """Run the 2-node job for `method` into `run_dir`; returns its wall seconds. Raises if a node fails."""
    from pipeline.train.launch.launcher import free_port

    port = PORT if link else free_port()  # each namespace has its own ports
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    logs = [run_dir.parent / f"{method}.node{rank}.log" for rank in (0, 1)]
    started = time.perf_counter()
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            cmd = node_command(method, epochs, run_dir, rank, link, port, seed)
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    codes = [proc.wait() for proc in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"{method}: nodes exited with {codes}\n{logs[0].read_text()[-2000:]}")
    return time.perf_counter() - started


def summarise(method: str, run_dir: Path, wall_s: float) -> dict[str, Any]:
    """Per-step time and bytes after the first epoch (the default warm-up), and the final accuracy, from the run's
    metrics."""
    lines = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    all_steps = [r for r in lines if "step" in r and "loss" in r]
    steps = [r for r in all_steps if r["epoch"] > 0]
    seconds = [r["batch"] / r["samples_per_s"] for r in steps]
    return {
        "method": method,
        "steps": len(all_steps),
        "s_per_step": statistics.fmean(seconds),
        "median_s_per_step": statistics.median(seconds),
        "bytes_per_step": statistics.fmean(r["comm_bytes"] for r in steps),
        "val_accuracy": [r["val_accuracy"] for r in lines if "val_accuracy" in r][-1],
        "wall_s": wall_s,
        "ran": dict(Counter(r["compression"] for r in steps)),  # auto's choices; the method itself otherwise
    }


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Bars of s/step per method, each labelled with its speed-up and accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar([r["method"] for r in rows], [r["s_per_step"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows, strict=True):
        label = f"{r['speedup']:.1f}x\nacc {r['val_accuracy']:.3f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("s / step (mean after warm-up)")
    ax.set_title(title)
    ax.margins(y=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of this run (docs/benchmarks.md generates its own from the JSON)."""
    header = "| method | s/step | speed-up vs none | MB/step | val accuracy | Δ accuracy vs none |"
    out = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['s_per_step']:.2f}", f"{r['speedup']:.1f}x", f"{r['bytes_per_step'] / 1e6:.2f}"]
        cells += [f"{r['val_accuracy']:.4f}", f"{r['accuracy_delta']:+.4f}"]
        out.append(f"| `{r['method']}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run(methods: list[str], epochs: int, link: WeakLink | None, tmp: Path, seed: int) -> list[dict[str, Any]]:
    """Train every method in turn and summarise it; progress on stderr."""
    rows = []
    for method in methods:
        print(f"[{time.strftime('%H:%M:%S')}] {method} ...", file=sys.stderr, flush=True)
        wall = train_nodes(method, epochs, tmp / method, link, seed)
        rows.append(summarise(method, tmp / method, wall))
        print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    base = next(r for r in rows if r["method"] == "none")
    for r in rows:
        r["speedup"] = base["s_per_step"] / r["s_per_step"]
        r["accuracy_delta"] = r["val_accuracy"] - base["val_accuracy"]
    return rows


def main() -> None:
    """Parse the arguments, build the link, train every method, write JSON + PNG, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", choices=("weak", "loopback"), default="weak")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="run.seed: initial weights, data order, validation split")
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (auto too); must include none")
    parser.add_argument("--suffix", default="", help="appended to the result files' names")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if "none" not in methods:
        parser.error("--methods must include none: speed-ups are measured against it")
    if args.link == "weak" and (why := unavailable()):
        sys.exit(f"error: --link weak: {why} (try --link loopback)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.link == "weak":
            with WeakLink(args.rate, args.delay_ms) as link:
                rows = run(methods, args.epochs, link, Path(tmp), args.seed)
        else:
            rows = run(methods, args.epochs, None, Path(tmp), args.seed)
    link_desc = f"{args.rate}, {args.delay_ms:g} ms each way" if args.link == "weak" else "loopback, unshaped"
    suffix = ("" if args.link == "weak" else "_loopback") + (f"_seed{args.seed}" if args.seed else "") + args.suffix
    meta = {"model": "resnet18", "data": "digits @32px", "nodes": 2, "ranks_per_node": 1, "epochs": args.epochs}
    meta["seed"] = args.seed
    meta |= {"link": link_desc, "train": TRAIN, "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}
    meta |= cpu_facts()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"train_compression{suffix}.json").write_text(json.dumps({**meta, "methods": rows}, indent=2) + "\n")
    plot(rows, f"resnet18, 2 nodes, {link_desc}", RESULTS / f"train_compression{suffix}.png")
    print(table(rows))


if __name__ == "__main__":
    main()
