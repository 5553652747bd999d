"""Final accuracy of every fixed compression method at its defaults on the quickstart, over several seeds.

    python benchmarks/train_compression_seeds.py [--seeds 0,1,2] [--methods none,fp16,...]

One validation split of the digits holds 360 images, so one point is 3.6 of them, and a change of CPU moved `none`
itself by one image with the same seed: a method's loss against `none` is only worth reading as a mean over seeds.
Each run is the real CLI, `pipeline train --config configs/quickstart.toml` (small_cnn, 16 px, 8 epochs, 2 gloo
ranks, every compression knob at its default) with `train.compression` and `run.seed` set; `run.seed` draws the
initial weights, the data order and the validation split. Writes benchmarks/results/train_compression_seeds.json and
prints a table of each method's accuracy per seed and its mean difference to `none`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "hooks"))  # benchmark_tables: the table docs/measurements.md generates

from benchmark_tables import train_compression_seeds as table  # noqa: E402
from benchmarks.train_compression import cpu_facts  # noqa: E402
from pipeline.config import toml_value  # noqa: E402
from pipeline.train.compression import registry  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "train_compression_seeds.json"
METHODS = tuple(name for name, method in registry.METHODS.items() if method.install is None)
"""Every fixed method of the registry (`auto` chooses among them)."""


def accuracy(method: str, seed: int, run_dir: Path) -> float:
    """Train the quickstart with `method` and `seed` into `run_dir`; its final validation accuracy."""
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(ROOT / "configs" / "quickstart.toml")]
    cmd += ["--run-dir", str(run_dir), "--set", f"train.compression={toml_value(method)}", "--set", f"run.seed={seed}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method} seed {seed}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads((run_dir / "train" / "summary.json").read_text())["val_accuracy"]


def main() -> None:
    """Train every method at every seed, write the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; must include none")
    args = parser.parse_args()
    seeds, methods = [int(s) for s in args.seeds.split(",")], args.methods.split(",")
    if "none" not in methods:
        parser.error("--methods must include none: differences are measured against it")
    acc: dict[str, list[float]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for method in methods:
                acc[method].append(accuracy(method, seed, Path(tmp, f"{method}-{seed}")))
                print(f"seed {seed} {method}: {acc[method][-1]:.4f}", file=sys.stderr, flush=True)
    rows = {
        m: {
            "val_accuracy": a,
            "mean_delta_points": 100 * statistics.fmean(x - n for x, n in zip(a, acc["none"], strict=True)),
        }
        for m, a in acc.items()
    }
    result = {"config": "configs/quickstart.toml", "seeds": seeds, **cpu_facts(), "methods": rows}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
