"""The registry of compression methods: every record complete, every registered method training on two real gloo
ranks (exact bytes on the wire per step, accuracy against `none`), the settings it checks, and the docs' table."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import models
from pipeline import layout
from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.train.compression import powersgd, registry, sign
from pipeline.train.compression.method import Method
from pipeline.train.rank import runtime, strategy
from pipeline.train.rank.worker import Trainer
from tests.train.compression.helpers import method_config, small_cnn_params
from tests.train.ranks import run_ranks

METHODS = tuple(name for name, m in registry.METHODS.items() if m.install is None)
"""The fixed methods, each registering its own hook (`auto` switches among them: test_auto.py)."""
BLOCKING = tuple(name for name, m in registry.METHODS.items() if m.blocking)
WARMUP, RANK, FRACTION, PERIOD = 3, 2, 0.01, 4
KNOBS = {"compression_warmup_steps": WARMUP, "powersgd_rank": RANK, "topk_fraction": FRACTION}
KNOBS["localsgd_period"] = PERIOD
SEEDS = (0, 1, 2)
Metrics = dict[str, list[dict[str, Any]]]


def train_methods(root: Path, epochs: int, batch_size: int, seed: int, scaled: bool, extra: dict[str, Any]) -> None:
    """On each rank: train every method from the same seed into root/<method>/ (rank 0 writes the metrics);
    `scaled`: each method `epochs` times its `epochs_factor`, as `train.epochs = "auto"` gives it."""
    rt = runtime.init(method_config("none", epochs, batch_size).train)
    try:
        for method in METHODS:
            own = epochs * registry.METHODS[method].epochs_factor if scaled else epochs
            Trainer(method_config(method, own, batch_size, seed, **extra), root / method, rt).fit()
    finally:
        dist.destroy_process_group()


def _train_all(root: Path, epochs: int, batch_size: int, seed: int = 0, scaled: bool = False, **extra: Any) -> Metrics:
    run_ranks(train_methods, root, epochs, batch_size, seed, scaled, extra)
    return {m: [json.loads(x) for x in (root / m / layout.METRICS).read_text().splitlines()] for m in METHODS}


@pytest.fixture(scope="module")
def brief(tmp_path_factory: pytest.TempPathFactory) -> Metrics:
    """Metrics of one 12-step epoch per method with small knobs (one spawn of two ranks for all of them)."""
    return _train_all(tmp_path_factory.mktemp("brief"), 1, 128, **KNOBS)


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory) -> list[Metrics]:
    """Metrics of the quickstart per method at default knobs, one set per seed of `SEEDS`: 8 epochs of 23 steps
    (16 for the methods that average models: what `auto` gives them), global batch 64."""
    return [_train_all(tmp_path_factory.mktemp(f"converged{seed}"), 8, 64, seed, scaled=True) for seed in SEEDS]


def expected_bytes(method: str, step: int) -> int:
    """Analytic payload of `step` (1-based) for small_cnn, whose gradients fit one DDP bucket."""
    params = small_cnn_params()
    numel = sum(p.numel() for p in params)
    full = numel * 4
    if registry.METHODS[method].fsdp:  # casts of the full gradient
        return full // 2 if method != "none" else full
    if method == "star":
        return full
    # 12 steps an epoch, PERIOD 4: the averagings of local SGD and DiLoCo end the epoch's thirds (localsgd.Schedule).
    if method == "diloco":  # no warm-up: the models averaged in fp32 at the first, then changes in 8 bits
        return 0 if step % PERIOD else full if step == PERIOD else numel + 4 * len(params)
    if method == "streaming":  # the models averaged at once in fp32, then each turn's changes in 8 bits
        return 0 if (step - 1) % PERIOD else full if step == 1 else numel + 4 * len(params)
    if step <= WARMUP:
        return full
    if method == "powersgd":
        return powersgd.sent_numel([p.shape for p in params], RANK) * 4
    if method == "topk":
        return math.ceil(numel * FRACTION) * 8
    if method == "sign":
        return sign.size(params)
    # localsgd: no gradient traffic after the warm-up's WARMUP steps; the parameters averaged at the thirds' ends.
    return 0 if step % PERIOD else full


@pytest.mark.parametrize("method", METHODS)
def test_comm_bytes_match_the_analytic_size(brief: Metrics, method: str) -> None:
    steps = [r for r in brief[method] if "step" in r]
    assert len(steps) == 12
    assert [r["comm_bytes"] for r in steps] == [expected_bytes(method, r["step"]) for r in steps]
    assert all(r["comm_s"] >= 0 for r in steps)
    assert sum(r["comm_s"] for r in steps) > 0


def test_compressed_methods_send_less_than_none() -> None:
    full = expected_bytes("none", WARMUP + 1)
    assert expected_bytes("powersgd", WARMUP + 1) < full / 5
    assert expected_bytes("topk", WARMUP + 1) <= full * FRACTION * 2 + 8  # fp32 value + int32 index per entry
    assert expected_bytes("sign", WARMUP + 1) < full / 10  # small_cnn's stem and head go whole


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_accuracy_at_default_knobs_is_within_a_point_of_none(converged: list[Metrics], method: str) -> None:
    """On the mean over seeds: one validation split moves a method by a point (3.6 of its 360 images)."""

    def final(metrics: Metrics, m: str) -> float:
        return [r["val_accuracy"] for r in metrics[m] if "val_accuracy" in r][-1]

    none = statistics.fmean(final(run, "none") for run in converged)
    assert none >= 0.95
    assert statistics.fmean(final(run, method) for run in converged) >= none - 0.01


def train_then_resume(root: Path) -> None:
    """On each rank: one epoch of `sign` and of `powersgd` (the default one-epoch warm-up: all plain all-reduce),
    then the same run resumed for a second epoch."""
    rt = runtime.init(validate({}, "test").train)
    try:
        for method in ("sign", "powersgd"):
            for epochs in (1, 2):
                Trainer(method_config(method, epochs, 128), root / method, rt).fit()
    finally:
        dist.destroy_process_group()


def test_a_resumed_run_does_not_warm_up_again(tmp_path: Path) -> None:
    """The warm-up is counted from the run's first step, not the process's: resuming after it compresses at once
    (PowerSGD after the 2 plain steps its error feedback needs)."""
    run_ranks(train_then_resume, tmp_path)
    full = 4 * sum(p.numel() for p in small_cnn_params())
    for method, plain in (("sign", 0), ("powersgd", 2)):
        lines = [json.loads(x) for x in (tmp_path / method / layout.METRICS).read_text().splitlines()]
        sent = [r["comm_bytes"] for r in lines if "step" in r]
        assert len(sent) == 24, method
        assert sent[:12] == [full] * 12, method  # the first epoch is the warm-up
        assert sent[12 : 12 + plain] == [full] * plain, method
        assert max(sent[12 + plain :]) < full / 4, method


@pytest.mark.parametrize("method", registry.METHODS.values(), ids=registry.METHODS)
def test_every_record_is_complete(method: Method) -> None:
    """What the rest of training reads of a method is there, and says what it can: no field left to a guess."""
    assert method.name and method.about.endswith(".")
    assert (method.hook is None) != (method.install is None), "a hook, or an installer of its own: one of them"
    assert method.rounds >= 1 and method.min_warmup_steps >= 0
    assert method.fsdp or method.reduce_dtype is None, "a reduce dtype is FSDP's"
    assert not (method.fsdp and method.warms_up), "FSDP's casts have no warm-up to count"
    assert method.min_warmup_steps == 0 or method.warms_up
    if method.auto:  # what `auto` predicts and times it from
        assert method.hook is not None and method.payload_bytes is not None and method.after_step is None
        knobs = registry.knobs(method_config(method.name, 1, 2).train, models.build_model("small_cnn", 10, 1), 0)
        assert 0 < method.payload_bytes(small_cnn_params(), knobs) <= 4 * knobs.numel
    assert any(m.auto for m in registry.METHODS.values() if m.name == "none"), "auto's baseline is `none`"


def test_the_registry_is_the_list_of_accepted_names() -> None:
    for name in registry.METHODS:
        assert registry.check(method_config(name, 1, 2).train).name == name
    with pytest.raises(PipelineError, match=r"^train.compression: 'gzip' is not a method \(one of: none, star, fp16, "):
        registry.check(method_config("gzip", 1, 2).train)


def test_incompatible_settings_are_refused_before_training() -> None:
    with pytest.raises(PipelineError, match=r"compression_warmup_steps must be >= 2 for powersgd"):
        registry.check(method_config("powersgd", 1, 2, compression_warmup_steps=1).train)
    with pytest.raises(PipelineError, match=r"'topk' works with DDP only \(fsdp: none, fp16, .*bf16.*\)$"):
        registry.check(validate({"train": {"compression": "topk", "strategy": "fsdp"}}, "test").train)


def test_warmup_steps_follow_the_epochs_the_settings_and_a_resume() -> None:
    cfg = method_config("topk", 1, 2).train
    assert registry.warmup_steps(cfg, 23) == 23  # one epoch
    assert registry.warmup_steps(cfg.model_copy(update={"compression_warmup_epochs": 0.5}), 23) == 12
    assert registry.warmup_steps(cfg.model_copy(update={"compression_warmup_steps": 5}), 23) == 5
    psgd = method_config("powersgd", 1, 2, compression_warmup_epochs=0).train
    assert registry.warmup_steps(psgd, 23) == 2  # PowerSGD's error feedback needs 2
    assert registry.warmup_steps(cfg, 23, done=10) == 13  # resumed part-way through the warm-up
    assert registry.warmup_steps(cfg, 23, done=40) == 0
    assert registry.warmup_steps(psgd, 23, done=40) == 2  # again after each start of the process


def test_a_new_method_is_one_record(tmp_path: Path) -> None:
    """The registry, `check` and the docs table take a record as it is: nothing else lists the methods."""
    copy = dataclasses.replace(registry.METHODS["fp16"], name="fp16-copy", about="A copy.")
    registry.METHODS["fp16-copy"] = copy
    try:
        assert registry.check(method_config("fp16-copy", 1, 2).train) is copy
        assert "| `fp16-copy` | A copy. |" in registry.table()
    finally:
        del registry.METHODS["fp16-copy"]


def record_buckets(root: Path) -> None:
    """On each rank: resnet18 (45 MB of gradients) wrapped per method; rank 0 records the bucket sizes each hook
    call saw in the second step (DDP rebuilds its buckets after the first)."""
    rt = runtime.init(validate({}, "test").train)
    register = DistributedDataParallel.register_comm_hook
    seen: list[int] = []

    def spying(ddp: DistributedDataParallel, state: Any, hook: Any) -> None:
        def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            seen.append(bucket.buffer().numel())
            return hook(state, bucket)

        counted.__annotations__ = hook.__annotations__  # DDP checks them as live objects, not this file's strings
        register(ddp, state, counted)

    DistributedDataParallel.register_comm_hook = spying  # type: ignore[method-assign]
    try:
        for method in ("none", "topk", "sign", *BLOCKING):
            cfg = method_config(method, 1, 2, **KNOBS).train
            model, _ = strategy.wrap(models.build_model("resnet18", 10, 3), cfg, rt)
            for _ in range(2):
                seen.clear()
                model(torch.randn(2, 3, 32, 32)).sum().backward()
            if rt.is_main:
                (root / f"{method}.buckets").write_text(json.dumps(seen))
    finally:
        DistributedDataParallel.register_comm_hook = register  # type: ignore[method-assign]
        dist.destroy_process_group()


def test_blocking_methods_send_the_gradients_in_one_bucket(tmp_path: Path) -> None:
    run_ranks(record_buckets, tmp_path)
    numel = sum(p.numel() for p in models.build_model("resnet18", 10, 3).parameters())
    default = json.loads((tmp_path / "none.buckets").read_text())
    assert len(default) > 1 and sum(default) == numel  # plain all-reduces overlap the backward pass
    for method in BLOCKING:
        assert json.loads((tmp_path / f"{method}.buckets").read_text()) == [numel], method
    for method in ("topk", "sign"):  # asynchronous: DDP's own buckets, overlapping the backward pass like none
        assert json.loads((tmp_path / f"{method}.buckets").read_text()) == default, method
