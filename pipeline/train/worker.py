"""One training rank, started by torchrun: ``python -m pipeline.train.worker --run-dir DIR``.

Reads the run's config snapshot, trains with the configured strategy, validates and checkpoints at each epoch end,
and resumes from ``train/checkpoints/latest`` when it exists. Rank 0 alone shows progress and writes metrics,
the dataset description and the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

import models
from pipeline import data
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir, write_json
from pipeline.train import checkpoint, layout, runtime, strategy
from pipeline.train.metrics import MetricsLog
from pipeline.train.runtime import Runtime

VAL_BATCH = 256


def cosine_lr(peak: float, step: int, total: int) -> float:
    """Learning rate for `step` (0-based) of `total`: cosine decay from `peak` towards zero.

    A pure function of the step, so a resumed run continues the schedule without any saved scheduler state.
    """
    progress = min(step / max(total, 1), 1.0)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """Each rank's share of the global batch (rounded down: the effective global batch is a multiple of ranks)."""
    if global_batch < world_size:
        raise PipelineError(f"train.batch_size: {global_batch} is smaller than the number of ranks ({world_size})")
    return global_batch // world_size


class Trainer:
    """Model, optimizer and data of one rank, and the epoch loop around them."""

    def __init__(self, cfg: Config, run_dir: Path, rt: Runtime) -> None:
        self.cfg, self.run_dir, self.rt = cfg, run_dir, rt
        splits = data.load(cfg.data, cfg.run.seed, channels=models.spec_for(cfg.model.name).channels)
        self.info = splits.info
        self.sampler = DistributedSampler(splits.train, rt.world_size, rt.rank, shuffle=True, seed=cfg.run.seed)
        batch = per_rank_batch(cfg.train.batch_size, rt.world_size)
        self.train_loader = DataLoader(splits.train, batch_size=batch, sampler=self.sampler)
        # Disjoint strided shards: every validation image is counted exactly once across ranks.
        own_val = Subset(splits.val, range(rt.rank, len(splits.val), rt.world_size))
        self.val_loader = DataLoader(own_val, batch_size=VAL_BATCH)
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        net = models.build_model(cfg.model.name, len(self.info.classes), self.info.channels, cfg.model.weights)
        self.model, self.comm = strategy.wrap(net, cfg.train, rt)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.total_steps = cfg.train.epochs * len(self.train_loader)
        self.ckpt_root = run_dir / layout.CHECKPOINTS
        self.samples = 0
        self.train_seconds = 0.0

    def resume(self) -> tuple[int, int]:
        """(first epoch to run, global step so far): from the `latest` checkpoint when there is one."""
        found = checkpoint.resumable(self.ckpt_root, self.cfg)
        if found is None:
            return 0, 0
        meta = checkpoint.load(found, self.model, self.optim)
        if self.rt.is_main:
            print(f"resuming from {found.name} (epoch {meta['epoch'] + 1} done)", file=sys.stderr)
        return meta["epoch"] + 1, meta["step"]

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One optimizer step on this rank's batch; returns its loss."""
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.zero_grad(set_to_none=True)
        with self.rt.autocast():
            loss = F.cross_entropy(self.model(x.to(self.rt.device)), y.to(self.rt.device))
        loss.backward()
        self.optim.step()
        return loss.item()

    def train_epoch(self, epoch: int, step: int, log: MetricsLog | None) -> int:
        """Run one epoch; rank 0 logs every step. Returns the global step after it."""
        self.sampler.set_epoch(epoch)
        self.model.train()
        bar = tqdm(
            self.train_loader,
            desc=f"epoch {epoch + 1}/{self.cfg.train.epochs}",
            unit="step",
            file=sys.stderr,
            disable=not self.rt.is_main,
            dynamic_ncols=True,
        )
        last = time.perf_counter()
        for x, y in bar:
            lr = cosine_lr(self.cfg.train.lr, step, self.total_steps)
            loss = self.train_step(x, y, lr)
            comm_bytes = self.comm.take()
            # Wall time between steps, data loading included; every rank's batch has the same size.
            now, samples = time.perf_counter(), len(x) * self.rt.world_size
            seconds, last = now - last, now
            self.samples, self.train_seconds = self.samples + samples, self.train_seconds + seconds
            step += 1
            if log is not None:
                row = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "comm_bytes": comm_bytes}
                log.write({**row, "samples_per_s": samples / seconds})
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # the bar redraws at its own pace
        return step

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        """(accuracy, mean loss) over the whole validation split, each rank evaluating its own shard."""
        strategy.sync_buffers(self.model)
        net = strategy.unwrap(self.model).eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        for x, y in self.val_loader:
            x, y = x.to(self.rt.device), y.to(self.rt.device)
            with self.rt.autocast():
                logits = net(x).float()
            totals[0] += (logits.argmax(dim=1) == y).sum()
            totals[1] += len(y)
            totals[2] += F.cross_entropy(logits, y, reduction="sum")
        dist.all_reduce(totals)
        net.train()
        correct, count, loss_sum = totals.tolist()
        return correct / max(count, 1), loss_sum / max(count, 1)

    def end_epoch(self, epoch: int, step: int, log: MetricsLog | None) -> float:
        """Validate, log and checkpoint after `epoch`; returns the validation accuracy."""
        accuracy, val_loss = self.validate()
        if log is not None:
            log.write({"epoch": epoch, "val_accuracy": accuracy, "val_loss": val_loss})
            tqdm.write(f"epoch {epoch + 1}: val_accuracy {accuracy:.4f} val_loss {val_loss:.4f}", sys.stderr)
        meta = {"epoch": epoch, "step": step, "world_size": self.rt.world_size}
        meta["resume_key"] = checkpoint.resume_key(self.cfg)
        checkpoint.save(self.ckpt_root, self.model, self.optim, meta, self.cfg.train.keep_checkpoints)
        return accuracy

    def fit(self) -> dict[str, Any]:
        """Train the remaining epochs, validating and checkpointing after each; return the summary fields."""
        start_epoch, step = self.resume()
        log = None
        if self.rt.is_main:
            write_json(self.run_dir / layout.DATASET, self.info.to_dict())
            log = MetricsLog(self.run_dir / layout.METRICS, start_epoch)
        accuracy: float | None = None
        try:
            for epoch in range(start_epoch, self.cfg.train.epochs):
                step = self.train_epoch(epoch, step, log)
                accuracy = self.end_epoch(epoch, step, log)
        finally:
            if log is not None:
                log.close()
        if accuracy is None:  # every epoch was already done: report what the checkpoint scores
            accuracy, _ = self.validate()
        return {
            "epochs": self.cfg.train.epochs,
            "steps": step,
            "val_accuracy": accuracy,
            "world_size": self.rt.world_size,
            "global_batch": per_rank_batch(self.cfg.train.batch_size, self.rt.world_size) * self.rt.world_size,
            "backend": self.rt.backend,
            "precision": self.rt.precision,
            "compression": self.cfg.train.compression,
            "samples_per_s": self.samples / self.train_seconds if self.train_seconds else 0.0,
        }


def train(run_dir: Path) -> None:
    """Train this rank from the run directory's config snapshot; rank 0 writes train/summary.json at the end."""
    cfg = RunDir(run_dir).load_config()
    started = time.perf_counter()
    rt = runtime.init(cfg.train)
    try:
        summary = Trainer(cfg, run_dir, rt).fit()
        if rt.is_main:
            write_json(run_dir / layout.SUMMARY, {**summary, "seconds": round(time.perf_counter() - started, 3)})
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun; a user-fixable problem prints one `error:` line and exits with code 2."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.train.worker", description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding config.json")
    args = parser.parse_args(argv)
    try:
        train(args.run_dir)
    except PipelineError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and closed by now; skipping the interpreter's teardown of torch saves ~1.5 s per rank.
    os._exit(status)
