"""Compression methods on two real gloo ranks: exact bytes on the wire per step, and accuracy against `none`."""

from __future__ import annotations

import json
import math
import statistics
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import models
from pipeline import layout
from pipeline.config import FSDP_COMPRESSION, Config, TrainConfig, validate
from pipeline.errors import PipelineError
from pipeline.train import compression
from pipeline.train.rank import runtime, strategy
from pipeline.train.rank.worker import Trainer
from tests.train.ranks import run_ranks

METHODS = tuple(m for m in typing.get_args(TrainConfig.model_fields["compression"].annotation) if m != "auto")
"""The fixed methods (`auto` picks among them: tests/train/compression/test_auto_compression.py)."""
WARMUP, RANK, FRACTION, PERIOD = 3, 2, 0.01, 4
KNOBS = {"compression_warmup_steps": WARMUP, "powersgd_rank": RANK, "topk_fraction": FRACTION}
KNOBS["localsgd_period"] = PERIOD
SEEDS = (0, 1, 2)
Metrics = dict[str, list[dict[str, Any]]]


def method_config(method: str, epochs: int, batch_size: int, seed: int = 0, **extra: Any) -> Config:
    """digits/small_cnn on 2 ranks with `method` and `extra` train settings; everything else (`seed` too, which
    draws the weights, the data order and the validation split) the same for every method."""
    train = {"epochs": epochs, "batch_size": batch_size, "compression": method, **extra}
    return validate({"run": {"seed": seed}, "train": train}, "test")


def train_methods(root: Path, epochs: int, batch_size: int, seed: int, extra: dict[str, Any]) -> None:
    """On each rank: train every method from the same seed into root/<method>/ (rank 0 writes the metrics)."""
    rt = runtime.init(method_config("none", epochs, batch_size).train)
    try:
        for method in METHODS:
            Trainer(method_config(method, epochs, batch_size, seed, **extra), root / method, rt).fit()
    finally:
        dist.destroy_process_group()


def _train_all(root: Path, epochs: int, batch_size: int, seed: int = 0, **extra: Any) -> Metrics:
    run_ranks(train_methods, root, epochs, batch_size, seed, extra)
    return {m: [json.loads(x) for x in (root / m / layout.METRICS).read_text().splitlines()] for m in METHODS}


@pytest.fixture(scope="module")
def brief(tmp_path_factory: pytest.TempPathFactory) -> Metrics:
    """Metrics of one 12-step epoch per method with small knobs (one spawn of two ranks for all of them)."""
    return _train_all(tmp_path_factory.mktemp("brief"), 1, 128, **KNOBS)


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory) -> list[Metrics]:
    """Metrics of the quickstart per method at default knobs, one set per seed of `SEEDS`: 8 epochs of 23 steps,
    global batch 64."""
    return [_train_all(tmp_path_factory.mktemp(f"converged{seed}"), 8, 64, seed) for seed in SEEDS]


def _params() -> list[torch.Tensor]:
    return list(models.build_model("small_cnn", 10, 1).parameters())


def powersgd_numel(params: list[torch.Tensor], rank: int) -> int:
    """Elements PowerSGD sends: P (n x r) and Q (m x r) per matrix worth compressing, the rest as they are."""
    total = 0
    for p in params:
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if p.dim() > 1 and n * m > 2 * (n + m) * r else p.numel()
    return total


def expected_bytes(method: str, step: int) -> int:
    """Analytic payload of `step` (1-based) for small_cnn, whose gradients fit one DDP bucket."""
    params = _params()
    numel = sum(p.numel() for p in params)
    full = numel * 4
    if method in FSDP_COMPRESSION:  # casts of the full gradient
        return full // 2 if method != "none" else full
    if step <= WARMUP:
        return full
    if method == "powersgd":
        return powersgd_numel(params, RANK) * 4
    if method == "topk":
        return math.ceil(numel * FRACTION) * 8
    if method == "sign":
        return compression.sign_size(params)
    # localsgd: no gradient traffic; the parameters are averaged after step WARMUP + 1, then every PERIOD steps.
    return full if (step - 1 - WARMUP) % PERIOD == 0 else 0


@pytest.mark.parametrize("method", METHODS)
def test_comm_bytes_match_the_analytic_size(brief: Metrics, method: str) -> None:
    steps = [r for r in brief[method] if "step" in r]
    assert len(steps) == 12
    assert [r["comm_bytes"] for r in steps] == [expected_bytes(method, r["step"]) for r in steps]
    assert all(r["comm_s"] >= 0 for r in steps)
    assert sum(r["comm_s"] for r in steps) > 0


def test_sign_sends_a_bit_per_entry_a_scale_per_row_and_small_tensors_whole() -> None:
    signed, vector, small = torch.zeros(64, 32), torch.zeros(17), torch.zeros(10, 50)
    assert compression.sign_size([signed]) == 2048 // 8 + 4 * 64
    assert compression.sign_size([signed, vector, small]) == 2048 // 8 + 4 * 64 + 4 * (17 + 500)


def sign_one_step(root: Path) -> None:
    """On each rank: one backward pass of a model with a signed matrix (2048 entries), a small one (320) and two
    vectors under sign with no warm-up, on data of its own; writes the averaged gradients and its own."""
    rt = runtime.init(validate({}, "test").train)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 10))
        cfg = method_config("sign", 1, 2, compression_warmup_steps=0).train
        ddp, _ = strategy.wrap(model, cfg, rt)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rt.rank))
        own = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
        ddp(x).square().mean().backward()
        out = {"mean": [p.grad.tolist() for p in model.parameters()], "own": [g.tolist() for g in own]}
        (root / f"rank{rt.rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def rank_results(fn: Callable[[Path], None], root: Path) -> list[dict[str, Any]]:
    """Run `fn(root)` on two ranks; what each wrote to root/rank<N>.json."""
    run_ranks(fn, root)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_sign_averages_small_tensors_exactly_and_the_rest_as_scaled_signs(tmp_path: Path) -> None:
    ranks = rank_results(sign_one_step, tmp_path)
    assert ranks[0]["mean"] == ranks[1]["mean"]
    mean = [torch.tensor(g) for g in ranks[0]["mean"]]
    own = [[torch.tensor(g) for g in r["own"]] for r in ranks]
    weight, bias, head, head_bias = ((a + b) / 2 for a, b in zip(*own, strict=True))
    for got, exact in ((bias, mean[1]), (head, mean[2]), (head_bias, mean[3])):
        torch.testing.assert_close(got, exact)
    scaled = [g[0].abs().mean(1, keepdim=True) * torch.where(g[0] >= 0, 1.0, -1.0) for g in own]
    torch.testing.assert_close(mean[0], (scaled[0] + scaled[1]) / 2)
    assert not torch.allclose(mean[0], weight)  # the large matrix did go as signs


def test_compressed_methods_send_less_than_none() -> None:
    full = expected_bytes("none", WARMUP + 1)
    assert expected_bytes("powersgd", WARMUP + 1) < full / 5
    assert expected_bytes("topk", WARMUP + 1) <= full * FRACTION * 2 + 8  # fp32 value + int32 index per entry
    assert expected_bytes("sign", WARMUP + 1) < full / 10  # small_cnn's stem and head go whole
    resnet = list(models.build_model("resnet18", 10, 3).parameters())
    assert compression.sign_size(resnet) < 4 * sum(p.numel() for p in resnet) / 30


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_accuracy_at_default_knobs_is_within_a_point_of_none(converged: list[Metrics], method: str) -> None:
    """On the mean over seeds: one validation split moves a method by a point (3.6 of its 360 images)."""

    def final(metrics: Metrics, m: str) -> float:
        return [r["val_accuracy"] for r in metrics[m] if "val_accuracy" in r][-1]

    none = statistics.fmean(final(run, "none") for run in converged)
    assert none >= 0.95
    assert statistics.fmean(final(run, method) for run in converged) >= none - 0.01


def test_default_knobs_scale_with_the_model() -> None:
    assert compression.default_topk_fraction(20_234) == 0.1  # small_cnn: 2023 entries
    assert compression.default_topk_fraction(11_181_642) == 0.01  # resnet18: 111,817 entries
    assert compression.default_topk_fraction(200_000) == pytest.approx(2048 / 200_000)
    cfg = validate({"train": {"compression": "topk"}}, "test").train
    assert compression.warmup_steps(cfg, 23) == 23  # one epoch
    assert compression.warmup_steps(cfg.model_copy(update={"compression_warmup_epochs": 0.5}), 23) == 12
    assert compression.warmup_steps(cfg.model_copy(update={"compression_warmup_steps": 5}), 23) == 5
    powersgd = validate({"train": {"compression": "powersgd", "compression_warmup_epochs": 0}}, "test").train
    assert compression.warmup_steps(powersgd, 23) == 2  # PowerSGD's error feedback needs 2
    assert compression.warmup_steps(cfg, 23, done=10) == 13  # resumed part-way through the warm-up
    assert compression.warmup_steps(cfg, 23, done=40) == 0
    assert compression.warmup_steps(powersgd, 23, done=40) == 2  # again after each start of the process


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
    full = 4 * sum(p.numel() for p in _params())
    for method, plain in (("sign", 0), ("powersgd", 2)):
        lines = [json.loads(x) for x in (tmp_path / method / layout.METRICS).read_text().splitlines()]
        sent = [r["comm_bytes"] for r in lines if "step" in r]
        assert len(sent) == 24, method
        assert sent[:12] == [full] * 12, method  # the first epoch is the warm-up
        assert sent[12 : 12 + plain] == [full] * plain, method
        assert max(sent[12 + plain :]) < full / 4, method


def test_powersgd_numel_matches_the_analytic_count() -> None:
    params = _params()
    assert compression.powersgd_numel([p.shape for p in params], 4) == powersgd_numel(params, 4)


def test_powersgd_is_refused_where_no_matrix_shrinks() -> None:
    cfg = validate({"train": {"compression": "powersgd", "compression_warmup_steps": 2}}, "test").train
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(PipelineError, match=r"^train.compression 'powersgd': no weight matrix .* rank 8"):
        compression.resolve(cfg, tiny)
    assert compression.resolve(cfg, models.build_model("small_cnn", 10, 1)).powersgd_rank == 8


def test_sign_packing_round_trips_and_is_one_bit_per_entry() -> None:
    x = torch.randn(1001)
    x[3] = 0.0
    packed = compression.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 / 8)
    signs = compression.unpack_signs(packed, 1001)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_scaled_signs_are_each_rows_scale_times_its_signs() -> None:
    shapes = [torch.Size([7, 1]), torch.Size([1, 3]), torch.Size([3, 100]), torch.Size([2, 2, 5])]
    x = torch.randn(sum(s.numel() for s in shapes))
    scales = compression.row_scales(list(x.split([s.numel() for s in shapes])), shapes)
    assert scales.numel() == 7 + 1 + 3 + 2
    row_sizes = [s.numel() // s[0] for s in shapes for _ in range(s[0])]
    expected = scales.repeat_interleave(torch.tensor(row_sizes)) * torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(compression.scaled_signs(compression.pack_signs(x), scales, shapes), expected)
    assert scales[0] == x[0].abs()  # the first tensor's rows are single entries


def _magnitudes() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    heavy = torch.randn(200_000, generator=generator).abs() * torch.rand(200_000, generator=generator) ** 3
    strided = torch.rand(20_000, generator=generator)
    strided[:: compression.TOPK_SAMPLE_STRIDE] += 10.0  # the sample sees only these: its threshold keeps too few
    return {"heavy-tailed": heavy, "strided": strided, "ties": torch.ones(50_000), "small": torch.rand(300)}


@pytest.mark.parametrize("name", ["heavy-tailed", "strided", "ties", "small"])
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.1, 0.6])
def test_largest_selects_what_topk_selects(name: str, fraction: float) -> None:
    magnitude = _magnitudes()[name]
    k = compression.topk_size(magnitude.numel(), fraction)
    index = compression.largest(magnitude, k)
    assert index.numel() == k and index.unique().numel() == k
    # The same values as topk's (ties may pick other entries of equal magnitude).
    expected = magnitude.topk(k).values
    assert torch.equal(magnitude[index].sort(descending=True).values, expected)


def test_every_configurable_method_has_a_hook() -> None:
    assert set(compression.HOOKS) == set(METHODS)


def test_incompatible_settings_are_config_errors() -> None:
    with pytest.raises(PipelineError, match=r"compression_warmup_steps must be >= 2 for powersgd"):
        validate({"train": {"compression": "powersgd", "compression_warmup_steps": 1}}, "test")
    with pytest.raises(PipelineError, match=r"'topk' works with DDP only"):
        validate({"train": {"compression": "topk", "strategy": "fsdp"}}, "test")


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
        for method in ("none", "topk", "sign", *compression.BLOCKING):
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
    for method in compression.BLOCKING:
        assert json.loads((tmp_path / f"{method}.buckets").read_text()) == [numel], method
    for method in ("topk", "sign"):  # asynchronous: DDP's own buckets, overlapping the backward pass like none
        assert json.loads((tmp_path / f"{method}.buckets").read_text()) == default, method


def step_in_buckets(root: Path) -> None:
    """On each rank: resnet18 (3 DDP buckets) under top-k and sign with no warm-up, 3 SGD steps on data of its own;
    writes a checksum of the weights."""
    rt = runtime.init(validate({}, "test").train)
    try:
        for method in ("topk", "sign"):
            cfg = method_config(method, 1, 2, compression_warmup_steps=0, topk_fraction=0.01).train
            model, _ = strategy.wrap(models.build_model("resnet18", 10, 3), cfg, rt)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            data = torch.Generator().manual_seed(rt.rank)
            for _ in range(3):
                optim.zero_grad()
                model(torch.randn(4, 3, 32, 32, generator=data)).logsumexp(dim=1).mean().backward()
                optim.step()
            weights = sum(p.detach().double().sum().item() for p in model.parameters())
            (root / f"{method}.{rt.rank}").write_text(repr(weights))
    finally:
        dist.destroy_process_group()


def test_asynchronous_gathers_in_several_buckets_keep_every_rank_identical(tmp_path: Path) -> None:
    """Each bucket's all_gather is still running when the next bucket's hook starts: the ranks must still match
    every gather with its counterpart, so that they average the same gradients and hold the same weights."""
    run_ranks(step_in_buckets, tmp_path)
    for method in ("topk", "sign"):
        assert (tmp_path / f"{method}.0").read_text() == (tmp_path / f"{method}.1").read_text(), method


def average_int8(root: Path) -> None:
    """On each rank: parameters of its own, averaged once in fp32 (no anchor yet), then moved by a rank-specific
    delta and averaged in 8 bits; writes what it ends with, the exact mean of the moves and the bytes sent."""
    runtime.init(validate({}, "test").train)
    try:
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(rank)
        params = [torch.randn(100, 10, generator=gen), torch.randn(7, generator=gen)]
        averager = compression.Int8DeltaAverager(period=1, warmup_steps=0)
        averager.average_parameters(params)
        first = [p.clone() for p in params]
        gens = [torch.Generator().manual_seed(10 + r) for r in (0, 1)]
        moves = [[torch.randn(p.shape, generator=g) for p in params] for g in gens]
        for p, move in zip(params, moves[rank], strict=True):
            p.add_(move)
        averager.average_parameters(params)
        exact = [f + (a + b) / 2 for f, a, b in zip(first, *moves, strict=True)]
        out = {"params": [p.tolist() for p in params], "exact": [e.tolist() for e in exact], "sent": averager.sent}
        (root / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_int8_local_sgd_averaging_agrees_on_every_rank_in_a_quarter_of_the_bytes(tmp_path: Path) -> None:
    ranks = rank_results(average_int8, tmp_path)
    assert ranks[0]["params"] == ranks[1]["params"]  # bit-identical: the same payloads summed in the same order
    for got, exact in zip(ranks[0]["params"], ranks[0]["exact"], strict=True):
        error = (torch.tensor(got) - torch.tensor(exact)).abs().max().item()
        assert 0 < error < 0.05  # int8 of moves up to ~4: half a step of max/127 per rank
    assert ranks[0]["sent"] == 1000 + 7 + 2 * 4  # one byte per entry, one fp32 scale per tensor
