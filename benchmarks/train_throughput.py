"""Samples/s of `pipeline train` against a minimal hand-written DDP loop and Lightning: same model, data, batch, ranks.

    python benchmarks/train_throughput.py [--epochs 10] [--repeats 5]

All run under torchrun with 2 gloo ranks on the built-in digits (small_cnn, global batch 64). Samples/s is the
same measure for all: samples of all training steps over the wall time between steps (data loading included,
validation and checkpoints excluded). The Lightning arm (`Trainer(strategy="ddp")`) needs the `bench` extra
(`pip install -e .[bench]`); without it that arm is skipped and stored as null. Writes
benchmarks/results/train_throughput.json and prints a table.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the Lightning arm imports its modules on the ranks, so the extra stays optional
    import lightning
    import torch

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


def _lightning_module(model: torch.nn.Module) -> lightning.LightningModule:
    """`model` as the smallest LightningModule: cross-entropy step and the same AdamW as the baseline."""
    import lightning
    import torch
    import torch.nn.functional as F

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=1e-4)

    return Module()


def _throughput_callback(out: Path) -> lightning.Callback:
    """A callback timing steps exactly as `hand_loop` does; rank 0 writes the result and what it ran as."""
    import lightning
    import torch

    class Throughput(lightning.Callback):
        def __init__(self) -> None:
            self.samples, self.seconds, self.last = 0, 0.0, 0.0

        def on_train_epoch_start(self, trainer: lightning.Trainer, _: lightning.LightningModule) -> None:
            self.last = time.perf_counter()  # the clock restarts each epoch, so epoch-end work is not counted

        def on_train_batch_end(
            self, trainer: lightning.Trainer, _: lightning.LightningModule, __: object, batch: Any, ___: int
        ) -> None:
            # Ranks step on equal shares (the sampler pads), so this rank's batch times world is the step's samples.
            now = time.perf_counter()
            self.samples += len(batch[0]) * trainer.world_size
            self.seconds, self.last = self.seconds + now - self.last, now

        def on_train_end(self, trainer: lightning.Trainer, _: lightning.LightningModule) -> None:
            if trainer.is_global_zero:
                facts = {
                    "world_size": torch.distributed.get_world_size(),
                    # Under torchrun the environment is TorchElasticEnvironment and the launcher starts no children.
                    "environment": type(trainer.strategy.cluster_environment).__name__,
                    "children": len(getattr(trainer.strategy.launcher, "procs", [])),
                    "threads": torch.get_num_threads(),
                }
                out.write_text(json.dumps({"samples_per_s": self.samples / self.seconds, **facts}))

    return Throughput()


def lightning_loop(epochs: int, out: Path) -> None:
    """The Lightning arm, run on each rank: Trainer(strategy="ddp") finds torchrun's environment and spawns nothing."""
    import lightning
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    import models
    from pipeline import data
    from pipeline.config import validate

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    splits = data.load(validate({}, "bench").data, 0, channels=1)
    # The baseline's own sampler: Lightning keeps a DistributedSampler it is given and calls set_epoch on it.
    sampler = DistributedSampler(splits.train, world, rank, shuffle=True, seed=0)
    loader = DataLoader(splits.train, batch_size=BATCH // world, sampler=sampler)
    torch.manual_seed(0)
    module = _lightning_module(models.build_model("small_cnn", 10, 1))
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_throughput_callback(out)],
    )
    trainer.fit(module, train_dataloaders=loader)


def _torchrun(args: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--standalone", *args]
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:  # the ranks' own traceback, not only torchrun's exit status
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")


def _run_ranks(flag: str, epochs: int, tmp: Path) -> dict[str, Any]:
    """Run this file's `flag` arm under torchrun and read what rank 0 wrote."""
    out = tmp / f"{flag.strip('-')}.json"
    _torchrun([str(Path(__file__).resolve()), flag, str(out), "--epochs", str(epochs)])
    return json.loads(out.read_text())


def run_hand(epochs: int, tmp: Path) -> float:
    """Samples/s of one hand-written run."""
    return float(_run_ranks("--hand", epochs, tmp)["samples_per_s"])


def lightning_version() -> str | None:
    """The installed Lightning's version, or None (and why, printed) when the `bench` extra is missing."""
    try:
        import lightning
    except ImportError as error:  # the extra is optional: the other two arms still make a valid comparison
        print(f"skipping the Lightning arm: {error} (pip install -e .[bench])")
        return None
    return lightning.__version__


def run_lightning(epochs: int, tmp: Path) -> float:
    """Samples/s of one Lightning run, after checking it ran as 2 ranks of 1 thread, not 2 x 2 processes."""
    result = _run_ranks("--lightning", epochs, tmp)
    assert result["world_size"] == RANKS and result["environment"] == "TorchElasticEnvironment", result
    assert result["children"] == 0, result
    assert result["threads"] == 1, result
    return float(result["samples_per_s"])


def run_pipeline(epochs: int, tmp: Path, index: int) -> float:
    """Samples/s of one `pipeline train` run (its summary.json)."""
    from pipeline import train
    from pipeline.config import validate
    from pipeline.manifest import create_run_dir, read_json

    cfg = validate({"train": {"epochs": epochs, "batch_size": BATCH, "nproc_per_node": RANKS}}, "bench")
    run = create_run_dir(cfg, tmp / f"run{index}")
    # torchrun inherits file descriptor 2, as under the CLI: point it, not just sys.stderr, at /dev/null.
    saved = os.dup(2)
    with open(os.devnull, "w") as quiet:
        os.dup2(quiet.fileno(), 2)
    try:
        train.run(cfg, run, log=lambda _: None)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return float(read_json(run.path / "train" / "summary.json")["samples_per_s"])


def _median_ratio(numerator: list[float] | None, hand: list[float]) -> float | None:
    """Median of the per-repeat ratios, None for a skipped arm. A repeat runs the arms back to back, so load from
    other jobs mostly falls on both sides of its ratio; the median drops a repeat that it did not."""
    return statistics.median(n / h for n, h in zip(numerator, hand, strict=True)) if numerator else None


def _print_table(hand: list[float], ours: list[float], light: list[float] | None, version: str | None) -> None:
    print("| loop | samples/s (median) |\n|---|---|")
    print(f"| hand-written DDP | {statistics.median(hand):.0f} |")
    print(f"| pipeline train | {statistics.median(ours):.0f} |")
    light_cell = f"{statistics.median(light):.0f}" if light else "skipped (not installed)"
    print(f'| {" ".join(filter(None, ["Lightning", version]))} Trainer(strategy="ddp") | {light_cell} |')
    print(f"ratio pipeline / hand-written: {_median_ratio(ours, hand):.3f}")
    if light:
        print(f"ratio Lightning / hand-written: {_median_ratio(light, hand):.3f}")


def main() -> None:
    """Interleave the arms (hand, pipeline, Lightning), `repeats` times each, and report medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hand", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lightning", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand or args.lightning:
        (hand_loop if args.hand else lightning_loop)(args.epochs, args.hand or args.lightning)
        return
    version = lightning_version()
    load_at_start = os.getloadavg()[0]  # with the one at the end: other jobs on the machine skew all arms
    hand: list[float] = []
    ours: list[float] = []
    light: list[float] | None = [] if version else None
    with tempfile.TemporaryDirectory() as tmp:
        # One of each per repeat, so load drift from other jobs on the machine falls on all arms alike.
        for i in range(args.repeats):
            hand.append(run_hand(args.epochs, Path(tmp)))
            ours.append(run_pipeline(args.epochs, Path(tmp), i))
            if light is not None:
                light.append(run_lightning(args.epochs, Path(tmp)))
    result = {
        "model": "small_cnn",
        "data": "digits",
        "ranks": RANKS,
        "global_batch": BATCH,
        "epochs": args.epochs,
        "hand_samples_per_s": hand,
        "pipeline_samples_per_s": ours,
        "lightning_samples_per_s": light,
        "lightning_version": version,
        "ratio": _median_ratio(ours, hand),
        "lightning_vs_hand": _median_ratio(light, hand),
        "cpus": os.cpu_count(),
        "load_average_1m_start": load_at_start,
        "load_average_1m": os.getloadavg()[0],
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    _print_table(hand, ours, light, version)


if __name__ == "__main__":
    main()
