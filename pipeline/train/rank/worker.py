"""One training rank, started by torchrun: ``python -m pipeline.train.rank.worker --run-dir DIR``.

Reads the run's config snapshot, trains with the configured strategy, validates and checkpoints at each epoch end,
and resumes from ``train/checkpoints/latest`` when it exists. Rank 0 alone shows progress and writes metrics,
the dataset description and the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

import models
from pipeline import data, layout, modelfile
from pipeline.config import Config, TrainConfig
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.library_warnings import route_library_warnings
from pipeline.manifest import RunDir
from pipeline.train.compression import autoplan, collectives, registry
from pipeline.train.compression.method import Epoch
from pipeline.train.rank import (
    batchnorm,
    checkpoint,
    finetune,
    plan,
    runtime,
    sampling,
    shares,
    stepping,
    strategy,
    thermal,
)
from pipeline.train.rank.metrics import MetricsLog
from pipeline.train.rank.runtime import Runtime

VAL_BATCH = 256
SETTLE_S = 30.0
"""Seconds a failing rank waits for its checkpoint write in flight, so that a finished one is still committed."""


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """Each rank's share of the global batch (rounded down: the effective global batch is a multiple of ranks)."""
    if global_batch < world_size:
        raise PipelineError(f"train.batch_size: {global_batch} is smaller than the number of ranks ({world_size})")
    return global_batch // world_size


class Trainer:
    """Model, optimizer and data of one rank, and the epoch loop around them."""

    def __init__(self, cfg: Config, run_dir: Path, rt: Runtime) -> None:
        self.cfg, self.run_dir, self.rt = cfg, run_dir, rt
        splits = self._load_data()
        self._make_loaders(splits)
        net, frozen = self._build_model(tuple(splits.train[0][0].shape))
        self.strategy, reason = strategy.choose(net, torch.zeros(1, *self.input_shape), self.batch, cfg.train, rt)
        if rt.is_main:
            print(f"strategy: {self.strategy} ({reason})", file=sys.stderr)
        self.ckpt_root = run_dir / layout.CHECKPOINTS
        self.resume_from = checkpoint.resumable(self.ckpt_root, cfg)
        self.train_cfg, self.choice = self._choose_compression(net)
        self._say_plan()
        self._wrap(net, frozen)
        self._count_steps()

    def _load_data(self) -> data.Splits:
        """Load this rank's splits and plan batch, epochs and rate for them."""
        cfg, rt, weights = self.cfg, self.rt, self.cfg.model.weights
        channels = models.spec_for(cfg.model.name).channels
        prior = modelfile.recorded_stats(weights) if weights is not None else None
        splits = data.load(
            runtime.data_config(cfg.data), cfg.run.seed, channels=channels, pretrained=weights is not None, prior=prior
        )
        self.info, self.skipped = splits.info, splits.skipped
        self.planned = sampling.train_size_to_plan(len(splits.train), rt)
        self.plan = plan.plan(cfg.train, self.planned, rt.world_size, pretrained=weights is not None)
        return splits

    def _say_plan(self) -> None:
        """Rank 0 says what it skipped and what `auto` settings became."""
        if not self.rt.is_main:
            return
        lines = [self.choice.line()] if self.choice else []
        if self.skipped:
            lines.append(f"data: skipped {len(self.skipped)} unreadable image(s), first {self.skipped[0]}")
        lines += [*self.plan.why, f"data.normalize {self.cfg.data.normalize}: {self.info.normalization} statistics"]
        print("\n".join(lines), file=sys.stderr)

    def _make_loaders(self, splits: data.Splits) -> None:
        """This rank's training, unaugmented-training and validation loaders."""
        cfg, rt = self.cfg, self.rt
        self.sampler, self.plain_sampler = sampling.samplers(splits, cfg.run.seed, rt)
        self.batch = per_rank_batch(self.plan.batch_size, rt.world_size)
        self.batches = [self.batch] * rt.world_size
        """Every rank's batch (train.balance: shares.split); this rank's is batches[rank]."""
        self.train_set = splits.train
        self.resumable = sampling.ResumableSampler(self.sampler)
        self.train_loader = DataLoader(splits.train, batch_size=self.batch, sampler=self.resumable)
        self.val_loader = DataLoader(sampling.own_validation(splits.val, rt), batch_size=VAL_BATCH)
        self.plain_loader = DataLoader(splits.train_eval, batch_size=self.batch, sampler=self.plain_sampler)

    def _build_model(self, input_shape: tuple[int, ...]) -> tuple[torch.nn.Module, set[str]]:
        """The model, the same on every rank (seeded, then checked), with `model.weights` loaded; and the names of the
        parameters `model.freeze` freezes."""
        cfg = self.cfg
        self.input_shape = input_shape
        torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
        net = models.build_model(cfg.model.name, len(self.info.classes), self.info.channels)
        self.dropped = self._load_weights(net)
        frozen = finetune.frozen_names(net, cfg.model.name, cfg.model.freeze)
        stepping.assert_same_weights(net, self.rt.device)
        return net, frozen

    def _choose_compression(self, net: torch.nn.Module) -> tuple[TrainConfig, autoplan.Choice | None]:
        """The train settings the run trains with, and `auto`'s choice between DiLoCo and the gradient methods
        (compression.autoplan): recorded in the checkpoint resumed from, else probed. Under DiLoCo the epochs are
        planned again, `auto` or set: a set count is the plain run's, and DiLoCo trains its epochs factor times it.
        """
        train = self.cfg.train
        if train.compression != autoplan.GRADIENTS or self.strategy != "ddp":
            return train, None
        recorded = checkpoint.read_meta(self.resume_from).get("compression") if self.resume_from else None
        if recorded in (autoplan.GRADIENTS, autoplan.DILOCO):
            choice = autoplan.Choice(recorded, "as the checkpoint resumed from recorded")
        else:
            x, y = next(iter(self.plain_loader))
            batch = x.to(self.rt.device), y.to(self.rt.device)
            candidates = [m for m in registry.METHODS.values() if m.auto]
            knobs = registry.knobs(train, net, 0, Epoch(len(self.train_loader)))
            choice = autoplan.probe(net, batch, knobs, candidates, self.rt.autocast)
        if choice.method == autoplan.GRADIENTS:
            return train, choice
        chosen = train.model_copy(update={"compression": choice.method})
        self.plan = plan.plan(chosen, self.planned, self.rt.world_size, pretrained=self.cfg.model.weights is not None)
        if train.epochs != "auto":  # `auto` promises the plain run's accuracy sooner: its epochs, in DiLoCo's measure
            self.plan = plan.scaled_epochs(self.plan, registry.method(chosen), "chosen by compression auto")
        return chosen, choice

    def _wrap(self, net: torch.nn.Module, frozen: set[str]) -> None:
        """Spread the model over the ranks with its compression, and build the optimizer and loss scaler."""
        cfg, rt = self.cfg, self.rt
        # The hooks count the warm-up in steps from here: a resumed run has done part or all of it already.
        meta = checkpoint.read_meta(self.resume_from) if self.resume_from else {"step": 0}
        warmup = registry.warmup_steps(self.train_cfg, len(self.train_loader), meta["step"])
        epoch = Epoch(len(self.train_loader), meta.get("next_batch", 0))  # a resume mid-epoch goes on where it was
        self.model, self.comm = strategy.wrap(net, self.train_cfg, rt, self.strategy, warmup, epoch)
        # FSDP swaps parameters for sharded ones in place and DDP wraps them: find them by name after wrapping.
        self.frozen = [p for n, p in strategy.unwrap(self.model).named_parameters() if n in frozen]
        self.freezing = False
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=self.plan.lr, weight_decay=cfg.train.weight_decay)
        self.scaler = stepping.make_scaler(rt, self.model)

    def _count_steps(self) -> None:
        """The schedule in steps, the heat controller, the checkpointer and the counters the loop keeps."""
        train = self.cfg.train
        self.event: str | None = None
        sensor = thermal.sensor(train.thermal_path)
        limit, every = train.thermal_limit_c, train.thermal_every_steps
        # FSDP's micro-batches meet every rank: the ranks agree on their count (pipeline/train/rank/thermal.py).
        agree = thermal.agree_max(self.rt.device) if self.strategy == "fsdp" else None
        self.thermal = thermal.Controller(train.accumulation, limit, sensor, every, self.batch, agree)
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = self.plan.epochs * self.steps_per_epoch
        self.warmup_steps = min(round(train.warmup_epochs * self.steps_per_epoch), self.total_steps)
        self.frozen_steps = self.cfg.model.freeze_epochs * self.steps_per_epoch
        self.bn_images = 0
        self.modes: batchnorm.ModeCheck | None = None
        # A save of each device's own has no collective across the link to hide in the background.
        per_node = checkpoint.per_node(self.strategy)
        across = self.rt.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", self.rt.world_size)) and not per_node
        background = checkpoint.background(train.checkpoint_async, self.rt.device, across)
        self.checkpointer = checkpoint.Checkpointer(self.ckpt_root, train.keep_checkpoints, background, per_node)
        # Such a save is a local write: after every averaging of local SGD or DiLoCo, a device lost then costs the
        # others at most the outer step in flight (docs/how-to/cluster.md#a-device-lost-for-good).
        self.save_averaged = train.checkpoint_every_steps is None and per_node and self.comm.averages_whole
        self.samples = 0
        self.train_seconds = 0.0
        # train.balance: shares of the batch follow the ranks' steps. DDP only (FSDP's shards gather in step), and
        # gradient methods only: the methods that average models weigh every rank's model alike, which is right for
        # equal shares only (docs/measurements.md#shares-of-the-batch).
        averages_models = registry.method(self.train_cfg).after_step is not None
        self.balancing = train.balance and self.strategy == "ddp" and self.rt.world_size > 1 and not averages_models
        # Under those that average models, a slow rank trains only some of the steps instead (shares.paces).
        self.pacing = train.balance and self.strategy == "ddp" and self.rt.world_size > 1 and self.comm.paced
        self.timing = self.balancing or self.pacing
        """Whether the ranks time their steps (shares of the batch, or of the steps)."""
        self.paces = [1.0] * self.rt.world_size
        self.even = (self.sampler, self.resumable, self.train_loader)
        self.forward_s = 0.0
        self.timed: list[tuple[float, float]] = []
        """(forward, optimizer) seconds of each step since the last evaluation (shares)."""
        self.walls: list[float] = []
        self.timings: list[shares.Timing] = []
        self.last_timings: list[shares.Timing] | None = None
        self.loss_weight = 1.0

    def _load_weights(self, net: torch.nn.Module) -> list[str]:
        """Load `model.weights` into `net` when set; rank 0 names the head tensors dropped for another class count."""
        path = self.cfg.model.weights
        if path is None:
            return []
        dropped = models.load_weights(net, self.cfg.model.name, path)
        if self.rt.is_main:
            what = f"replaced the classifier head, dropped {', '.join(dropped)}" if dropped else "every tensor fits"
            print(f"model.weights: {path}: {what}", file=sys.stderr)
        return dropped

    def resume(self) -> tuple[int, int, int]:
        """(epoch to run, global step so far, batches of that epoch already done): from `latest` if there is one."""
        found = self.resume_from
        if found is None:
            return 0, 0, 0
        outer = self.comm.outer_state(self.model)
        meta = checkpoint.load(found, self.model, self.optim, outer)
        if meta.get("outer_state"):
            self.comm.restore_outer(self.model, outer)
        if meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        epoch, batch = meta.get("next_epoch", meta["epoch"] + 1), meta.get("next_batch", 0)
        if self.balancing and len(meta.get("batches") or ()) == self.rt.world_size:
            self.batches = list(meta["batches"])  # the same images for the rest of the epoch
        if self.rt.is_main:
            print(f"resuming from {found.name} (epoch {epoch + 1}, batch {batch})", file=sys.stderr)
        return epoch, meta["step"], batch

    def save(self, epoch: int, step: int, next_batch: int, synced: bool = False) -> None:
        """Checkpoint on all ranks; `epoch` is the one in progress (done when `next_batch` is 0); `synced`: the
        buffers are already rank 0's (:func:`strategy.sync_buffers` since the last step)."""
        done = epoch if next_batch == 0 else epoch - 1
        meta = {"epoch": done, "step": step, "world_size": self.rt.world_size, "next_epoch": done + 1}
        meta |= {"next_batch": next_batch, "scaler": self.scaler.state_dict(), "batches": self.batches}
        meta["resume_key"] = checkpoint.resume_key(self.cfg)
        meta["compression"] = self.train_cfg.compression  # what `auto` chose, kept on resuming
        # DCP saves one rank's copy of replicated buffers: make them all rank 0's. A device's own save holds its
        # lead rank's (the lowest rank writes them): a broadcast would cost a round over the link.
        if not synced and not self.checkpointer.per_node:
            strategy.sync_buffers(self.model)
        self.checkpointer.save(self.model, self.optim, meta, self.comm.outer_state(self.model))

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One optimizer step; on out-of-memory, retried with half the micro-batch while it can shrink."""
        while True:
            try:
                return self._step(x, y, lr)
            except torch.OutOfMemoryError:
                why = self.thermal.out_of_memory()
                if why is None and self.thermal.agree is not None:
                    need = self.thermal.accumulation * 2
                    raise PipelineError(
                        f"out of memory under FSDP, whose micro-batches every rank runs alike: set "
                        f"train.accumulation = {need} (or a smaller train.batch_size)"
                    ) from None
                if why is None:
                    raise
                self.note(why)
                if self.rt.device.type == "cuda":
                    torch.cuda.empty_cache()

    def note(self, why: str) -> None:
        """Report a micro-batch change on stderr; the metrics line of the step records it too."""
        self.event = why
        print(f"rank {self.rt.rank}: {why}", file=sys.stderr)

    def _step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One optimizer step on this rank's batch, in `accumulation` micro-batches; returns its mean loss."""
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.zero_grad(set_to_none=True)
        self.forward_s = 0.0
        x, y = x.to(self.rt.device), y.to(self.rt.device)
        acc = self.thermal.accumulation
        parts = list(zip(x.chunk(acc), y.chunk(acc), strict=True))
        total = 0.0
        for i, (xs, ys) in enumerate(parts):
            with stepping.no_sync(self.model, skip=i < len(parts) - 1):
                with self.rt.autocast():
                    logits = self._timed_forward(xs)
                    # Weighted by its share, so the summed gradients equal those of the whole batch.
                    loss = F.cross_entropy(logits, ys) * (len(ys) / len(y) * self.loss_weight)
                self.scaler.scale(loss).backward()
            total += loss.item()
        if self.freezing:
            # Without a gradient AdamW leaves a parameter alone (no step, no weight decay, no moments), and
            # clipping does not count it. requires_grad stays on: DDP fixes the parameters it syncs when it wraps.
            for p in self.frozen:
                p.grad = None
        if self.cfg.train.grad_clip_norm is not None:
            self.scaler.unscale_(self.optim)
            # Under FSDP the gradients are DTensor shards: the norm is still the global one.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip_norm)
        start = time.perf_counter()
        self.scaler.step(self.optim)
        self.scaler.update()
        if self.timing:  # timing waits for the GPU: only where shares use it
            self.timed.append((self.forward_s, self._seconds_since(start)))
        self.comm.after_step(self.model)
        return total

    def _skip(self) -> None:
        """A step this rank does not train (shares.paces): only what the method counts each step."""
        self.comm.after_step(self.model)

    def _timed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output, with the seconds it took counted in this rank's timing (shares) when timed."""
        if not self.timing:
            return self.model(x)
        start = time.perf_counter()
        out = self.model(x)
        self.forward_s += self._seconds_since(start)
        return out

    def _seconds_since(self, start: float) -> float:
        """Seconds since `start` (time.perf_counter), the GPU's queued work included."""
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)
        return time.perf_counter() - start

    def _use_shares(self) -> None:
        """This rank's loader for `self.batches`: the one made at the start while they are equal, else a
        shares.ShareSampler's."""
        rank, own = self.rt.rank, self.batches[self.rt.rank]
        self.loss_weight = shares.loss_weight(self.batches, rank)
        if len(set(self.batches)) == 1:
            self.sampler, self.resumable, self.train_loader = self.even
            return
        first = rank - int(os.environ.get("LOCAL_RANK", 0)) if runtime.node_local_data() else 0
        size, seed = len(self.train_set), self.cfg.run.seed
        self.sampler = shares.sampler(size, self.steps_per_epoch, self.batches, rank, first, seed)
        self.resumable = sampling.ResumableSampler(self.sampler)
        self.train_loader = DataLoader(self.train_set, batch_size=own, sampler=self.resumable)

    def train_epoch(self, epoch: int, step: int, log: MetricsLog | None, skip: int = 0) -> int:
        """Run one epoch from its batch `skip`; rank 0 logs every step. Returns the global step after it."""
        self._use_shares()
        self.sampler.set_epoch(epoch)
        self.resumable.skip = skip * self.batches[self.rt.rank]
        self.model.train()
        bar = tqdm(
            self.train_loader,
            desc=f"epoch {epoch + 1}/{self.plan.epochs}",
            unit="step",
            file=sys.stderr,
            disable=not self.rt.is_main,
            dynamic_ncols=True,
        )
        last = time.perf_counter()
        every, due = self.cfg.train.checkpoint_every_steps, False
        for index, (x, y) in enumerate(bar, start=skip + 1):
            lr = finetune.scheduled_lr(self.plan.lr, step, self.total_steps, self.warmup_steps)
            self.freezing = bool(self.frozen) and step < self.frozen_steps
            x = stepping.augment(x, self.cfg.train.augment_shift, self.cfg.run.seed, self.rt.rank, step)
            self.event = None
            why = self.thermal.check(step)
            if why is not None:
                self.note(why)
            trains = self.comm.trains(self.rt.rank)
            loss = self.train_step(x, y, lr) if trains else self._skip()
            comm_bytes, comm_s = self.comm.counter.take()
            # Wall time between steps, data loading included; the global batch from this rank's share of it.
            now, samples = time.perf_counter(), len(x) * sum(self.batches) // self.batches[self.rt.rank]
            seconds, last = now - last, now
            self.samples, self.train_seconds = self.samples + samples, self.train_seconds + seconds
            self.comm.ran(seconds)
            self.walls.append(seconds)
            step += 1
            if log is not None:
                row = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "comm_bytes": comm_bytes}
                row["comm_s"] = comm_s if self.comm.timed else None
                acc = self.thermal.accumulation
                row |= {"accumulation": acc, "micro_batch": math.ceil(len(x) / acc), "batch": samples}
                row |= {"temperature_c": self.thermal.last_c, "batch_event": self.event, **self.comm.fields()}
                if self.pacing:
                    row["trained"] = trains
                log.write({**row, "samples_per_s": samples / seconds})
            if loss is not None:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # the bar redraws at its own pace
            self.checkpointer.poll()
            # Under a method that averages models every few steps, the save waits for the next averaging (streaming,
            # whose averagings never make the models one, settles them now): saved before it, the checkpoint would be
            # one rank's model alone (DCP keeps one copy of what DDP replicates), without the others' steps since the
            # last averaging, and DiLoCo's anchor would be that model too.
            due = due or bool(every and step % every == 0) or (self.save_averaged and self.comm.averaged)
            if due and index < self.steps_per_epoch and self.comm.ready_to_save(self.model):  # the end saves anyway
                self.save(epoch, step, next_batch=index)
                due = False
        return step

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float, batchnorm.ModeCheck | None]:
        """(accuracy, mean loss) over the whole validation split, each rank evaluating its own shard, and the
        eval-against-train-mode check on each rank's first training batch (rank 0 warns), summed over the ranks in
        one all-reduce (pipeline.train.compression.collectives says why one). Buffers must be in sync
        (strategy.sync_buffers)."""
        net = strategy.unwrap(self.model).eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        for x, y in self.val_loader:
            x, y = x.to(self.rt.device), y.to(self.rt.device)
            with self.rt.autocast():
                logits = net(x).float()
            totals[0] += (logits.argmax(dim=1) == y).sum()
            totals[1] += len(y)
            totals[2] += F.cross_entropy(logits, y, reduction="sum")
        if strategy.is_sharded(net):
            self._match_forwards(net, len(self.val_loader))
        net.train()
        x, y = next(iter(self.plain_loader))
        micro = math.ceil(len(x) / self.thermal.accumulation)  # one micro-batch: what training fits in memory
        modes = batchnorm.mode_counts(net, x[:micro].to(self.rt.device), y[:micro].to(self.rt.device), self.rt.autocast)
        timing = self._own_timing()
        both = torch.cat([t for t in (totals, modes, timing) if t is not None])
        collectives.star_all_reduce(both)
        correct, count, loss_sum = both[:3].tolist()
        if timing is not None:
            values = both[len(both) - len(timing) :].tolist()
            self.timings = [shares.Timing(round(values[i]), *values[i + 1 : i + 4]) for i in range(0, len(values), 4)]
        check = None if modes is None else batchnorm.ModeCheck.from_counts(both[3 : 3 + len(modes)])
        if check is not None and check.warning and self.rt.is_main:
            tqdm.write(f"warning: {check.warning}", sys.stderr)
        return correct / max(count, 1), loss_sum / max(count, 1), check

    def _own_timing(self) -> torch.Tensor | None:
        """With train.balance: zeros but for this rank's shares.Timing since the last call (the median step's: a
        step the scheduler cut into is not the rank's speed), which the sum over the ranks makes every rank's."""
        if not self.timing:
            return None
        timing = torch.zeros(4 * self.rt.world_size, dtype=torch.float64, device=self.rt.device)
        if self.timed and self.walls:
            forward, optimizer = (statistics.median(t) for t in zip(*self.timed, strict=True))
            own = [self.batches[self.rt.rank], forward, optimizer, statistics.median(self.walls)]
            timing[4 * self.rt.rank : 4 * self.rt.rank + 4] = torch.tensor(own, dtype=torch.float64)
        self.timed, self.walls = [], []
        return timing

    def _rebalance(self) -> None:
        """Shares of the next epoch's batch from the timings the last validation gathered and the epoch's before
        (shares.split); rank 0 says when they change."""
        new = shares.split(sum(self.batches), self.timings, self.last_timings)
        if new != self.batches and self.rt.is_main:
            took = ", ".join(f"{1000 * (shares.PASSES * t.forward_s + t.optimizer_s):.0f}" for t in self.timings)
            tqdm.write(f"shares: batches {self.batches} -> {new} (compute ms a step per rank: {took})", sys.stderr)
        self.batches, self.last_timings = new, self.timings

    def _repace(self) -> None:
        """Shares of the next epoch's steps from the timings the last validation gathered (shares.paces); rank 0
        says when they change."""
        new = shares.paces(self.timings)
        if new != self.paces and self.rt.is_main:
            took = ", ".join(f"{1000 * (shares.PASSES * t.forward_s + t.optimizer_s):.0f}" for t in self.timings)
            paces = ", ".join(f"{p:.2f}" for p in new)
            tqdm.write(f"paces: steps trained per rank {paces} (compute ms a step per rank: {took})", sys.stderr)
        self.paces = new
        self.comm.pace(new)

    def _match_forwards(self, net: torch.nn.Module, done: int) -> None:
        """FSDP forwards gather parameters collectively: run throwaway ones until every rank has run as many."""
        most = torch.tensor([done], device=self.rt.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        for _ in range(int(most.item()) - done):
            net(torch.zeros(1, *self.input_shape, device=self.rt.device))

    def recalibrate(self, epoch: int) -> None:
        """BatchNorm running statistics recomputed with the current weights (`train.bn_recalibration_batches`)."""
        self.plain_sampler.set_epoch(epoch)
        net = strategy.unwrap(self.model)  # not through DDP, which would broadcast rank 0's buffers each forward
        batches = self.cfg.train.bn_recalibration_batches
        pieces = self.thermal.accumulation  # micro-batches as training runs them now
        seen = batchnorm.recalibrate(net, self.plain_loader, batches, self.rt.device, self.rt.autocast, pieces)
        self.bn_images = seen * self.rt.world_size

    def end_epoch(self, epoch: int, step: int, log: MetricsLog | None) -> float:
        """Make the ranks' models one (the methods that average models: Compression.settle), recompute BatchNorm
        statistics, validate, compare eval and train mode, log and checkpoint after `epoch`; returns the validation
        accuracy."""
        settled = self.comm.settle(self.model)
        self.recalibrate(epoch)
        strategy.sync_buffers(self.model)
        accuracy, val_loss, self.modes = self.evaluate()
        if self.balancing:
            self._rebalance()
        if self.pacing:
            self._repace()
        if log is not None:
            row = {"epoch": epoch, "epochs": self.plan.epochs, "val_accuracy": accuracy, "val_loss": val_loss}
            if self.timing:
                row["forward_s"] = [t.forward_s for t in self.timings]
                row |= {"optimizer_s": [t.optimizer_s for t in self.timings], "next_batches": self.batches}
            if self.pacing:
                row["next_paces"] = self.paces
            row["comm_bytes"] = settled
            row["bn_images"] = self.bn_images
            if self.modes is not None:
                row |= {"eval_mode_accuracy": self.modes.eval_accuracy}
                row |= {"train_mode_accuracy": self.modes.train_mode_accuracy}
            log.write(row)
            tqdm.write(f"epoch {epoch + 1}: val_accuracy {accuracy:.4f} val_loss {val_loss:.4f}", sys.stderr)
        self.save(epoch, step, next_batch=0, synced=True)
        return accuracy

    def fit(self) -> dict[str, Any]:
        """Train the remaining epochs, validating and checkpointing after each; return the summary fields."""
        start_epoch, step, skip = self.resume()
        log = None
        if self.rt.is_main:
            write_json(self.run_dir / layout.DATASET, self.info.to_dict())
            log = MetricsLog(self.run_dir / layout.METRICS, start_epoch, step if skip else None)
        accuracy: float | None = None
        try:
            for epoch in range(start_epoch, self.plan.epochs):
                step = self.train_epoch(epoch, step, log, skip if epoch == start_epoch else 0)
                accuracy = self.end_epoch(epoch, step, log)
            self.checkpointer.wait()
        except BaseException:
            self.checkpointer.settle(SETTLE_S)
            raise
        finally:
            if log is not None:
                log.close()
        if accuracy is None:  # every epoch was already done: report what the checkpoint scores
            strategy.sync_buffers(self.model)
            accuracy, _, self.modes = self.evaluate()
        modes = self.modes
        return {
            "epochs": self.plan.epochs,
            "steps": step,
            "val_accuracy": accuracy,
            "world_size": self.rt.world_size,
            "global_batch": self.batch * self.rt.world_size,
            "lr": self.plan.lr,
            "normalization": self.info.normalization,
            "backend": self.rt.backend,
            "precision": self.rt.precision,
            "compression": self.cfg.train.compression,
            "compression_choice": self.choice.record() if self.choice else None,
            "compression_seconds": {k: round(v, 3) for k, v in self.comm.seconds.items()},
            "strategy": self.strategy,
            "samples_per_s": self.samples / self.train_seconds if self.train_seconds else 0.0,
            "bn_recalibration_images": self.bn_images,
            "eval_mode_accuracy": modes.eval_accuracy if modes else None,
            "train_mode_accuracy": modes.train_mode_accuracy if modes else None,
            "warnings": [modes.warning] if modes and modes.warning else [],
            "weights_dropped": self.dropped,
            "skipped_images": self.skipped,
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
        # No node's torchrun may exit before the summary exists: c10d can put rank 0 on a node other than node 0.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun; a user-fixable problem prints one `error:` line and exits with code 2."""
    route_library_warnings()
    parser = argparse.ArgumentParser(prog="python -m pipeline.train.rank.worker", description=__doc__)
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
