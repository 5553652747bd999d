"""`pipeline train` on one CUDA GPU: the nccl, autocast, FSDP, compression and resume paths, and their speed.

    python benchmarks/train_gpu.py [--epochs 3] [--arms "bf16 fsdp,bf16 sign"] [--out PATH]

Needs a CUDA GPU (exits 2 without one). Every arm is the real CLI, `pipeline train --nproc-per-node 1`, which on a
GPU means one nccl rank: resnet18 on the built-in digits at 32 px, every other key at its default. The arms:

- precision and strategy: fp32 DDP (the baseline every speed-up is against), bf16 and fp16 autocast under DDP,
  bf16 under FSDP2, and `precision = "auto"` (which should pick bf16 on a GPU that has it);
- each `train.compression` method at its defaults under bf16 DDP: one rank sends nothing over a wire, so these show
  that the hooks run on CUDA tensors and what their arithmetic costs on the GPU, not what they save on a link;
- resume: bf16 DDP and FSDP trained for one epoch, then started again in the same run directory for `--epochs`;
- refusals: two ranks on one GPU, and `backend = "nccl"` asked for where CUDA is hidden: one line each, exit 2.

Samples/s is the summary's (training steps only). Writes benchmarks/results/train_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import toml_value  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "train_gpu.json"
BASE = {"model.name": "resnet18", "data.image_size": 32}
ARMS: dict[str, dict[str, Any]] = {
    "fp32 ddp": {"train.precision": "fp32"},
    "bf16 ddp": {"train.precision": "bf16-mixed"},
    "fp16 ddp": {"train.precision": "fp16-mixed"},
    "bf16 fsdp": {"train.precision": "bf16-mixed", "train.strategy": "fsdp"},
    "auto precision": {},
    **{
        f"bf16 {m}": {"train.precision": "bf16-mixed", "train.compression": m}
        for m in ("fp16", "powersgd", "topk", "sign", "localsgd", "auto")
    },
}
RESUMED = ("bf16 ddp", "bf16 fsdp")
"""Arms also trained for one epoch, then started again in the same run directory for the rest."""
ARM_TIMEOUT_S = 180
SUMMARY_KEYS = ("backend", "precision", "strategy", "compression", "samples_per_s", "val_accuracy", "steps")


def train(run_dir: Path, settings: dict[str, Any], nproc: int = 1, env: dict[str, str] | None = None) -> dict:
    """Run `pipeline train` into `run_dir`; return its exit code, wall seconds, last output line and summary."""
    cmd = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run_dir), "--nproc-per-node", str(nproc)]
    cmd += [arg for key, value in settings.items() for arg in ("--set", f"{key}={toml_value(value)}")]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=ARM_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "wall_s": ARM_TIMEOUT_S, "last_line": "timed out", "resumed": False}
    lines = (done.stdout + done.stderr).strip().splitlines()
    summary_path = run_dir / "train" / "summary.json"
    summary = json.loads(summary_path.read_text()) if done.returncode == 0 and summary_path.exists() else {}
    return {
        "rc": done.returncode,
        "wall_s": round(time.perf_counter() - start, 1),
        "last_line": lines[-1] if lines else "",
        "resumed": any(line.startswith("resuming from") for line in lines),
        **{k: summary.get(k) for k in SUMMARY_KEYS},
    }


def gpu_facts() -> dict[str, Any]:
    """The GPU, driver-side CUDA and NCCL versions torch reports."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }


def main() -> int:
    """Run every arm, print the table, write the JSON."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset (fp32 ddp always runs)")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    names = ["fp32 ddp", *(a for a in args.arms.split(",") if a != "fp32 ddp")]
    if unknown := set(names) - set(ARMS):
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {list(ARMS)}")
    if not torch.cuda.is_available():
        print("train_gpu: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows[name] = train(Path(tmp, name.replace(" ", "-")), {**BASE, "train.epochs": args.epochs, **ARMS[name]})
            print(f"{name}: {rows[name]}", flush=True)
        for name in (n for n in RESUMED if n in names):
            resume_dir = Path(tmp, name.replace(" ", "-") + "-resumed")
            train(resume_dir, {**BASE, **ARMS[name], "train.epochs": 1})
            rows[f"{name} resumed"] = train(resume_dir, {**BASE, **ARMS[name], "train.epochs": args.epochs})
        rows["refused: 2 ranks, 1 GPU"] = train(Path(tmp, "two"), {**BASE, "train.epochs": 1}, nproc=2)
        rows["refused: nccl, CUDA hidden"] = train(
            Path(tmp, "hidden"), {**BASE, "train.backend": "nccl"}, env={"CUDA_VISIBLE_DEVICES": ""}
        )
    base = rows["fp32 ddp"]["samples_per_s"] or float("nan")
    for row in rows.values():
        row |= {k: row.get(k) for k in SUMMARY_KEYS}
        row["speedup_vs_fp32"] = round(row["samples_per_s"] / base, 2) if row["samples_per_s"] else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"facts": gpu_facts(), "epochs": args.epochs, "base": BASE, "arms": rows}, indent=2))
    print(f"\n{'arm':28} {'rc':>4} {'precision':>10} {'samples/s':>10} {'x fp32':>7} {'acc':>7} last line")
    for name, r in rows.items():
        sps = f"{r['samples_per_s']:.0f}" if r["samples_per_s"] else "-"
        acc = f"{r['val_accuracy']:.4f}" if r["val_accuracy"] is not None else "-"
        cells = [str(r["rc"]), r["precision"] or "-", sps, str(r["speedup_vs_fp32"] or "-"), acc]
        widths = (4, 10, 10, 7, 7)
        print(f"{name:28} " + " ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)), r["last_line"][:90])
    return 0


if __name__ == "__main__":
    sys.exit(main())
