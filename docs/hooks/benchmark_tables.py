"""The benchmark tables, read from `benchmarks/results/<name>.json` (docs/benchmarks.md, and any page that
shows one benchmark's numbers).

One function per results file a page shows, named after it (`<!-- generated: benchmark:<name> -->`); the numbers
come from the file and nothing else, rounded as the page shows them. What was measured, and what the numbers mean, is
the page's prose around each table. A benchmark script that prints its table imports the function from here.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from markdown_table import table

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""Where the benchmark scripts write their JSON (and the plots the page shows)."""


def load(name: str) -> dict[str, Any]:
    """benchmarks/results/<name>.json."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def signed(value: float, digits: int = 4) -> str:
    """A difference with its sign, a true minus for negatives (`+0.0000`, `−0.0167`)."""
    return f"{value:+.{digits}f}".replace("-", "−")


def deploy_rollout(data: dict[str, Any]) -> str:
    """SSH rollout: seconds per case (median of the repeats), against one device, and the bytes sent."""
    rows = [
        [r["case"], f"{r['seconds']:.2f}", f"{r['ratio_vs_1']:.2f}x", f"{r['bytes_sent'] / 1e6:.1f}"]
        for r in data["rows"]
    ]
    return table(["case", "seconds", "vs 1 device", "MB sent"], rows, right=(1, 2, 3))


def export_latency(data: dict[str, Any]) -> str:
    """Latency per model, batch and runtime, and p50 against PyTorch eager."""
    rows = [
        [r["model"], str(r["batch"]), r["runtime"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['vs_eager']:.2f}x"]
        for r in data["rows"]
    ]
    return table(["model", "batch", "runtime", "p50 ms", "p99 ms", "p50 vs eager"], rows, right=(1, 3, 4, 5))


def train_throughput(data: dict[str, Any]) -> str:
    """Samples/s of the three loops: the median of the repeats, each repeat, and the median (and range) of the
    per-repeat ratios to the hand-written loop (each repeat runs the three back to back)."""
    hand = data["hand_samples_per_s"]
    loops = [
        ("hand-written DDP loop", hand),
        ("`pipeline train`", data["pipeline_samples_per_s"]),
        (f'Lightning {data["lightning_version"]} `Trainer(strategy="ddp")`', data["lightning_samples_per_s"]),
    ]
    rows = []
    for name, runs in loops:
        ratios = [r / h for r, h in zip(runs, hand, strict=True)]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"
        each = ", ".join(f"{r:.0f}" for r in runs)
        rows.append([name, f"{statistics.median(runs):.0f}", each, spread])
    header = ["loop", f"samples/s (median of {len(hand)})", "each repeat", "vs hand-written, per repeat"]
    return table(header, rows, right=(1,))


def train_cluster_weaklink(data: dict[str, Any]) -> str:
    """4 stand-in Jetsons on a WiFi-like link, one run a row: epochs trained (one validation each), mean s/step
    after warm-up, speed-up against `none`,
    bytes a step, accuracy, what starting the run sent (code + data), and what crossed the links' host ends; then
    the wall seconds, collective bytes and link bytes until the run's first validation at or above none's final
    accuracy, each with its ratio to none's."""
    rows = []
    for r in data["runs"]:
        sent = r["bytes_sent"]["code"] + r["bytes_sent"]["data"]
        out, back = (sum(p[way] for p in r["link_bytes"].values()) for way in ("tx", "rx"))
        rows.append(
            [
                r["run"],
                str(len(r["curve"])) if "curve" in r else "–",
                f"{r['s_per_step']:.3f}",
                f"{r['speedup']:.2f}x",
                f"{r['bytes_per_step'] / 1e3:.1f}",
                f"{r['val_accuracy']:.4f}",
                f"{sent / 1e6:.2f} MB",
                f"{out / 1e6:.1f} / {back / 1e6:.1f} MB",
                to_none_accuracy(r, "wall_s", 1, "{:.0f} s"),
                to_none_accuracy(r, "comm_bytes", 1e6, "{:.2f} MB"),
                to_none_accuracy(r, "link_bytes", 1e6, "{:.1f} MB"),
            ]
        )
    header = ["run", "epochs", "s/step", "speed-up vs none", "KB/step", "val accuracy", "code + data sent"]
    header += ["link bytes out / back", "to none's accuracy", "collective bytes to it", "link bytes to it"]
    return table(header, rows, right=tuple(range(1, len(header))))


def to_none_accuracy(run: dict[str, Any], key: str, scale: float, form: str) -> str:
    """`run`'s `key` at its first validation at or above none's final accuracy, divided by `scale` and written with
    `form`, and its ratio to none's; `never` when it did not get there, `–` in results from before this was
    measured."""
    if "to_target" not in run:
        return "–"
    if run["to_target"] is None:
        return "never"
    return f"{form.format(run['to_target'][key] / scale)} ({run['to_target_vs_none'][key]:.2f}x)"


def train_compression(data: dict[str, Any]) -> str:
    """One 2-node job per method across the link: mean s/step after warm-up (the fastest in bold), speed-up and
    accuracy against `none`, bytes a step; for `auto`, the methods it ran after warm-up."""
    fastest = min(m["s_per_step"] for m in data["methods"])
    rows = []
    for m in data["methods"]:
        bold = "**" if m["s_per_step"] == fastest else ""
        name = f"`{m['method']}`"
        if m["method"] == "auto":
            name += " (after warm-up: " + ", ".join(f"`{k}` {n} steps" for k, n in m["ran"].items()) + ")"
        rows.append(
            [
                name,
                f"{bold}{m['s_per_step']:.2f}{bold}",
                f"{bold}{m['speedup']:.1f}×{bold}",
                f"{m['bytes_per_step'] / 1e6:.2f}",
                f"{m['val_accuracy']:.4f}",
                signed(m["accuracy_delta"]),
            ]
        )
    header = ["method", "s/step", "speed-up vs none", "MB/step", "val accuracy", "Δ accuracy vs none"]
    return table(header, rows, right=(1, 2, 3, 4, 5))


def points(value: float) -> str:
    """A difference in points, two decimals with its sign; one that rounds to nothing is `±0.00`."""
    text = signed(value, 2)
    return "±0.00" if text[1:] == "0.00" else text


def train_compression_seeds(data: dict[str, Any]) -> str:
    """Every method's final accuracy at each seed, and its mean difference to `none` in points (none's own left
    empty)."""
    rows = [
        [
            f"`{name}`",
            *(f"{a:.4f}" for a in m["val_accuracy"]),
            "" if name == "none" else points(m["mean_delta_points"]),
        ]
        for name, m in data["methods"].items()
    ]
    header = ["method", *(f"seed {s}" for s in data["seeds"]), "mean Δ vs `none` (points)"]
    return table(header, rows, right=tuple(range(1, len(header))))


def train_compression_changing(data: dict[str, Any]) -> str:
    """The link changing mid-run: training seconds against the best fixed method, accuracy, and the mean s/step in
    each of the link's phases (the first phase after the compression warm-up)."""
    edges = [data["train"]["compression_warmup_steps"], *data["changes_at_step"], None]
    phases = [link.split()[0] for link in data["links"]]
    rows = []
    for m in data["methods"]:
        steps = m["s_per_step"]
        means = [statistics.mean(steps[lo:hi]) for lo, hi in itertools.pairwise(edges)]
        rows.append(
            [
                f"`{m['method']}`",
                f"{m['train_s']:.1f}",
                f"{m['vs_best_fixed']:.2f}×",
                f"{m['val_accuracy']:.4f}",
                signed(m["accuracy_delta"]),
                *(f"{s:.2f}" for s in means),
            ]
        )
    header = ["method", "training s", "vs best fixed", "val accuracy", "Δ vs none", *(f"s/step, {p}" for p in phases)]
    return table(header, rows, right=(1, 2, 3, 4, 5, 6, 7))


def train_gpu(data: dict[str, Any], rerun: dict[str, Any]) -> str:
    """Every arm that trained, in the benchmark's order; an arm re-run later (`rerun`, train_gpu_fsdp.json) shows
    that run's numbers, marked †, without a ratio to an fp32 run it did not have."""
    rows = []
    for name in [*data["arms"], *(n for n in rerun["arms"] if n not in data["arms"])]:
        again = rerun["arms"].get(name)
        arm = again or data["arms"][name]
        if arm.get("samples_per_s") is None:  # refused before training (the page says how)
            continue
        ratio = "–" if again else f"{arm['speedup_vs_fp32']:.2f}"
        label = f"{name} †" if again else name
        rows.append([label, arm["precision"], f"{arm['samples_per_s']:.0f}", ratio, f"{arm['val_accuracy']:.4f}"])
    return table(["arm", "precision", "samples/s", "× fp32", "accuracy"], rows, right=(2, 3, 4))


def train_slow_rank(data: dict[str, Any]) -> str:
    """One rank held to half speed: s/step after the first epoch (the median, or the mean where the ranks wait for
    each other only at averagings) against the all-equal run's, final accuracy and its difference, and the shares
    the ranks ended with (of the batch, or of the steps)."""
    measure = data.get("measure", "median_s_per_step")
    rows = [
        [
            r["case"],
            f"{r[measure]:.3f}",
            f"{r['vs_equal']:.2f}x",
            f"{r['val_accuracy']:.4f}",
            signed(r["accuracy_delta"]),
            _shares(r),
        ]
        for r in data["rows"]
    ]
    step = "mean s/step" if measure == "mean_s_per_step" else "s/step"
    head = [f"case ({data.get('compression', 'none')})", step, "vs equal", "val accuracy", "vs equal", "at the end"]
    return table(head, rows, right=(1, 2, 3, 4))


def _shares(row: dict[str, Any]) -> str:
    """The shares a slow-rank run ended with: steps trained (paces) where they are not all 1, else the batches."""
    if row.get("paces") and any(p < 1 for p in row["paces"]):
        return "steps " + "/".join(f"{p:.2f}" for p in row["paces"])
    if row.get("batches") and len(set(row["batches"])) > 1:
        return "batches " + "/".join(map(str, row["batches"]))
    return "equal"


def train_memory(data: dict[str, Any]) -> str:
    """What one rank holds under DDP and FSDP, and its peak RSS, in MiB."""
    keys = ("params_mb", "grads_mb", "optimizer_mb", "peak_rss_mb")
    rows = [[name.upper(), *(f"{data[name][k]:.1f}" for k in keys)] for name in ("ddp", "fsdp")]
    header = ["per rank (MiB)", "parameters", "gradients", "optimizer state", "peak RSS"]
    return table(header, rows, right=(1, 2, 3, 4))


TABLES: dict[str, Callable[[], str]] = {
    "deploy_rollout": lambda: deploy_rollout(load("deploy_rollout")),
    "export_latency": lambda: export_latency(load("export_latency")),
    "train_throughput": lambda: train_throughput(load("train_throughput")),
    "train_cluster_weaklink": lambda: train_cluster_weaklink(load("train_cluster_weaklink")),
    "train_cluster_weaklink_bandwidth": lambda: train_cluster_weaklink(load("train_cluster_weaklink_bandwidth")),
    "train_compression": lambda: train_compression(load("train_compression")),
    "train_compression_defaults_now": lambda: train_compression(load("train_compression_defaults_now")),
    "train_compression_localsgd": lambda: train_compression(load("train_compression_localsgd")),
    "train_compression_seeds": lambda: train_compression_seeds(load("train_compression_seeds")),
    "train_compression_changing": lambda: train_compression_changing(load("train_compression_changing")),
    "train_gpu": lambda: train_gpu(load("train_gpu"), load("train_gpu_fsdp")),
    "train_memory": lambda: train_memory(load("train_memory")),
    "train_slow_rank": lambda: train_slow_rank(load("train_slow_rank")),
    "train_slow_rank_diloco": lambda: train_slow_rank(load("train_slow_rank_diloco")),
}
"""Every table the page may name, by results file."""
