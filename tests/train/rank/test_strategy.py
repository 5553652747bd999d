"""DDP and FSDP2 on two real gloo ranks: the same losses step by step, global gradient clipping, DCP checkpoints
in the same format, and `auto` choosing by memory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import models
from pipeline import data, layout
from pipeline.config import Config, validate
from pipeline.errors import PipelineError
from pipeline.files import read_json, write_json
from pipeline.train.rank import runtime, stepping, strategy
from pipeline.train.rank.worker import Trainer
from tests.train.ranks import run_ranks

CLIP = 0.5  # small enough to clip most steps: a per-shard norm would give other updates than the global one


def case(name: str, tiny: bool = False, **train: Any) -> Config:
    """digits/small_cnn on 2 ranks, one 12-step epoch (`tiny`: 3 steps, for CPU's slow fp16), clipping on; equal
    shares of the batch (these runs are compared number for number, and shares follow timings)."""
    base = {"epochs": 1, "batch_size": 128, "grad_clip_norm": CLIP, "precision": "fp32", "balance": False}
    return validate({"train": {**base, **train}, "data": {"val_fraction": 0.85 if tiny else 0.2}}, "test")


CASES = {
    "ddp": case("ddp", strategy="ddp"),
    "fsdp": case("fsdp", strategy="fsdp"),
    "fsdp-resumed": case("fsdp", strategy="fsdp", epochs=2),
    "fsdp-bf16": case("fsdp", tiny=True, strategy="fsdp", compression="bf16"),
    "auto-small": case("auto", tiny=True, strategy="auto", memory_budget_mb=1),
    "auto-large": case("auto", tiny=True, strategy="auto", memory_budget_mb=4096),
    "ddp-acc2": case("ddp", strategy="ddp", accumulation=2),
}
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
MATRIX_ACCURACY = 0.88
"""What every strategy x precision pair reaches in 3 epochs (69 steps) of MATRIX; fp32 reaches 0.917."""
MATRIX = {
    f"{name}-{precision}": case(
        name, strategy=name, precision=precision, epochs=3, batch_size=64, lr=2e-2, grad_clip_norm=None
    )
    for name in ("ddp", "fsdp")
    for precision in PRECISIONS
}
CASES |= MATRIX


RESUME = {"strategy": "ddp", "epochs": 2, "checkpoint_every_steps": 5, "augment_shift": 1}
STOP_AT = 17  # the step that never finishes: after the step-15 checkpoint, in the second epoch


class _Interrupted(Exception):
    pass


class _StopsAt(Trainer):
    """Stands in for a crash: every rank raises as it starts step STOP_AT."""

    calls = 0

    def train_step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        self.calls += 1
        if self.calls == STOP_AT:
            raise _Interrupted
        return super().train_step(x, y, lr)


def _check_mid_epoch_resume(root: Path, rt: runtime.Runtime) -> None:
    """An uninterrupted run, and one stopped at STOP_AT then resumed from its step checkpoint."""
    cfg = case("resume", **RESUME)
    Trainer(cfg, root / "straight", rt).fit()
    with contextlib.suppress(_Interrupted):
        _StopsAt(cfg, root / "resumed", rt).fit()
    if rt.is_main:
        write_json(root / "stopped.json", read_json(root / "resumed" / layout.LATEST / "trainer.json"))
    Trainer(cfg, root / "resumed", rt).fit()


def _check_heat(root: Path, rt: runtime.Runtime) -> None:
    """Train with a temperature file reading 90 °C against an 80 °C limit, checked every 5 steps."""
    hot = root / "temp"
    if rt.is_main:
        hot.write_text("90000\n")  # millidegrees, like a Jetson thermal zone
    dist.barrier()
    cfg = case("ddp", strategy="ddp", thermal_limit_c=80.0, thermal_path=str(hot), thermal_every_steps=5)
    Trainer(cfg, root / "hot", rt).fit()


def _check_fsdp_heat(root: Path, rt: runtime.Runtime) -> None:
    """FSDP with rank 1 alone hot (each rank its own temperature file): its micro-batches meet rank 0's, so both
    must split alike or neither finishes."""
    temp = root / f"temp-{rt.rank}"
    temp.write_text("90000\n" if rt.rank == 1 else "40000\n")
    cfg = case("fsdp", strategy="fsdp", thermal_limit_c=80.0, thermal_path=str(temp), thermal_every_steps=5)
    Trainer(cfg, root / "fsdp-hot", rt).fit()
    # Out of memory under FSDP is not retried on one rank alone (the others would wait in its collectives).
    try:
        _OutOfMemoryAbove(CASES["fsdp"], root / "fsdp-oom", rt).fit()
    except PipelineError as err:
        (root / f"fsdp-oom.{rt.rank}").write_text(str(err))


OOM_ABOVE = 16
"""Micro-batch size above which the model below raises CUDA's out-of-memory error."""


class _OutOfMemoryAbove(Trainer):
    """Stands in for a GPU too small for training's micro-batch: a training forward raises torch.OutOfMemoryError
    above OOM_ABOVE images (validation, which keeps no activations for a backward pass, fits)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)

        def check(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if module.training and len(inputs[0]) > OOM_ABOVE:
                raise torch.OutOfMemoryError(f"CUDA out of memory: stand-in for {len(inputs[0])} images")

        strategy.unwrap(self.model).register_forward_pre_hook(check)


def _check_oom(root: Path, rt: runtime.Runtime) -> None:
    """Train the "ddp" case on a model that cannot take more than OOM_ABOVE images at once."""
    _OutOfMemoryAbove(CASES["ddp"], root / "oom", rt).fit()


def _check_initial_weights(root: Path, rt: runtime.Runtime) -> None:
    """Record each rank's full initial FSDP weights, and whether ranks seeded apart are caught."""
    trainer = Trainer(CASES["fsdp"], root / "weights-probe", rt)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    digest = sum(float((v.double() * (i + 1)).sum()) for i, v in enumerate(full.values()))
    (root / f"weights.{rt.rank}").write_text(repr(digest))
    torch.manual_seed(rt.rank)
    try:
        stepping.assert_same_weights(nn.Linear(4, 4), rt.device)
    except RuntimeError as err:
        (root / f"caught.{rt.rank}").write_text(str(err))


FAST = ("ddp", "fsdp", "fsdp-bf16", "auto-small", "auto-large", "ddp-fp32", "fsdp-fp32")


def train_cases(root: Path, fast: bool) -> None:
    """On each rank: train the FAST cases (`fast`) or the others, which add the weights and resume checks.

    "fsdp-resumed" continues the "fsdp" run for a second epoch."""
    rt = runtime.init(CASES["ddp"].train)
    try:
        if fast:
            _check_oom(root, rt)
            _check_fsdp_heat(root, rt)
        else:
            _check_initial_weights(root, rt)
            _check_mid_epoch_resume(root, rt)
            _check_heat(root, rt)
        for name, cfg in CASES.items():
            if (name in FAST) != fast:
                continue
            run_dir = root / ("fsdp" if name == "fsdp-resumed" else name)
            own = dataclasses.replace(rt, precision=runtime.resolve_precision(cfg.train, rt.device))
            summary = Trainer(cfg, run_dir, own).fit()
            if rt.is_main:
                write_json(root / f"{name}.json", summary)
                (root / f"{name}.metrics.jsonl").write_text((run_dir / layout.METRICS).read_text())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FAST cases, in one spawn of two ranks."""
    root = tmp_path_factory.mktemp("strategies")
    run_ranks(train_cases, root, True)
    return root


@pytest.fixture(scope="module")
def more(runs: Path) -> Path:
    """The other cases (they need "fsdp" from `runs`), and the initial-weights and mid-epoch resume checks."""
    run_ranks(train_cases, runs, False)
    return runs


def _steps(root: Path, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (root / f"{name}.metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "step" in r]


def test_ddp_and_fsdp_losses_agree_step_by_step_with_clipping(runs: Path) -> None:
    ddp, fsdp = _steps(runs, "ddp"), _steps(runs, "fsdp")
    assert len(ddp) == len(fsdp) == 12
    for a, b in zip(ddp, fsdp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    assert ddp[-1]["loss"] < ddp[0]["loss"]
    assert read_json(runs / "fsdp.json")["strategy"] == "fsdp"


def test_fsdp_comm_bytes_is_the_padded_gradient_size_in_the_reduce_dtype(runs: Path) -> None:
    params = list(models.build_model("small_cnn", 10, 1).parameters())
    padded = sum(-(-p.shape[0] // 2) * 2 * (p.numel() // p.shape[0]) for p in params)
    assert {r["comm_bytes"] for r in _steps(runs, "fsdp")} == {padded * 4}
    assert {r["comm_bytes"] for r in _steps(runs, "fsdp-bf16")} == {padded * 2}
    assert {r["comm_s"] for r in _steps(runs, "fsdp")} == {None}  # not measured under FSDP


@pytest.mark.slow
@pytest.mark.usefixtures("more")
def test_fsdp_resumes_from_its_sharded_checkpoint(runs: Path) -> None:
    resumed = _steps(runs, "fsdp-resumed")
    assert [r["step"] for r in resumed] == list(range(1, 25))
    assert resumed[:12] == _steps(runs, "fsdp")
    assert read_json(runs / "fsdp" / layout.LATEST / "trainer.json")["epoch"] == 1


@pytest.mark.slow
@pytest.mark.usefixtures("more")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_checkpoint_has_the_ddp_format_and_loads_into_a_plain_model(runs: Path) -> None:
    model = models.build_model("small_cnn", 10, 1)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=runs / "fsdp" / layout.LATEST, no_dist=True)
    model.load_state_dict(state["model"])
    x, y = data.val_batch(data.load(CASES["fsdp"].data, 0, channels=1), 10_000)
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy == pytest.approx(read_json(runs / "fsdp-resumed.json")["val_accuracy"], abs=1e-6)


def test_auto_picks_fsdp_only_when_ddp_would_not_fit(runs: Path) -> None:
    assert read_json(runs / "auto-small.json")["strategy"] == "fsdp"
    assert read_json(runs / "auto-large.json")["strategy"] == "ddp"


def test_blocks_are_residual_blocks_or_layer_groups() -> None:
    small = strategy.blocks(models.build_model("small_cnn", 10, 1))
    assert [type(b) for b in small] == [nn.Sequential, nn.Sequential, nn.Linear]
    resnet = strategy.blocks(models.build_model("resnet18", 10, 3))
    assert [type(b).__name__ for b in resnet].count("BasicBlock") == 8


def test_activation_estimate_scales_with_the_batch() -> None:
    net = models.build_model("small_cnn", 10, 1)
    one = strategy.activation_bytes(net, torch.zeros(1, 1, 16, 16), 1)
    assert one > 32 * 16 * 16 * 4  # at least the first conv's output
    assert strategy.activation_bytes(net, torch.zeros(1, 1, 16, 16), 8) == 8 * one


@pytest.mark.slow
@pytest.mark.usefixtures("more")
def test_accumulation_syncs_once_per_step_and_follows_the_full_batch(runs: Path) -> None:
    full, acc = _steps(runs, "ddp"), _steps(runs, "ddp-acc2")
    assert [r["comm_bytes"] for r in acc] == [r["comm_bytes"] for r in full]  # no_sync: one all-reduce a step
    for a, b in zip(acc, full, strict=True):  # BatchNorm sees half batches: close, not equal
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05)


def _check_pair(runs: Path, name: str) -> None:
    summary = read_json(runs / f"{name}.json")
    assert (summary["strategy"], summary["precision"]) == tuple(name.split("-", 1))
    assert all(math.isfinite(r["loss"]) for r in _steps(runs, name))
    assert summary["val_accuracy"] >= MATRIX_ACCURACY
    # mixed precision costs no accuracy here: every pair ends near fp32 DDP
    assert summary["val_accuracy"] == pytest.approx(read_json(runs / "ddp-fp32.json")["val_accuracy"], abs=0.03)


@pytest.mark.parametrize("name", [n for n in MATRIX if n in FAST])
def test_fp32_trains_to_the_stated_accuracy_under_both_strategies(runs: Path, name: str) -> None:
    _check_pair(runs, name)


@pytest.mark.slow
@pytest.mark.usefixtures("more")
@pytest.mark.parametrize("name", [n for n in MATRIX if n not in FAST])
def test_mixed_precision_trains_to_the_stated_accuracy_under_both_strategies(runs: Path, name: str) -> None:
    _check_pair(runs, name)


@pytest.mark.slow
@pytest.mark.usefixtures("more")
def test_every_rank_starts_from_the_same_weights_and_a_mismatch_is_caught(runs: Path) -> None:
    assert (runs / "weights.0").read_text() == (runs / "weights.1").read_text()
    assert not (runs / "caught.0").exists()
    assert "initial weights differ from rank 0's" in (runs / "caught.1").read_text()


@pytest.mark.slow
@pytest.mark.usefixtures("more")
def test_a_run_stopped_mid_epoch_resumes_from_its_step_checkpoint_as_if_never_stopped(runs: Path) -> None:
    stopped = read_json(runs / "stopped.json")
    assert (stopped["step"], stopped["epoch"], stopped["next_epoch"], stopped["next_batch"]) == (15, 0, 1, 3)

    def lines(name: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in (runs / name / layout.METRICS).read_text().splitlines()]

    straight, resumed = lines("straight"), lines("resumed")
    assert [r.get("step") for r in resumed] == [r.get("step") for r in straight]
    for a, b in zip(straight, resumed, strict=True):
        for key in ("loss", "val_accuracy", "comm_bytes"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5)
    kept = sorted(p.name for p in (runs / "resumed" / layout.CHECKPOINTS).glob("step-*"))
    assert kept == ["step-20", "step-24"]
    assert sorted(p.name for p in (runs / "resumed" / layout.LATEST).glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]


def test_out_of_memory_halves_the_micro_batch_and_retries_the_step(runs: Path) -> None:
    oom, full = [json.loads(x) for x in (runs / "oom" / layout.METRICS).read_text().splitlines()], _steps(runs, "ddp")
    steps = [r for r in oom if "step" in r]
    assert [r["step"] for r in steps] == [r["step"] for r in full]  # no step lost
    assert {r["accumulation"] for r in steps} == {4}  # 64 per rank -> 32 -> 16
    assert steps[0]["batch_event"] == "out of memory: accumulation 4" and not any(r["batch_event"] for r in steps[1:])
    assert [r["batch"] for r in steps] == [r["batch"] for r in full]
    assert [r["comm_bytes"] for r in steps] == [r["comm_bytes"] for r in full]  # still one sync per step
    for a, b in zip(steps, full, strict=True):  # BatchNorm sees quarter batches: close, not equal
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05)


@pytest.mark.slow
@pytest.mark.usefixtures("more")
def test_heat_shrinks_the_micro_batch_but_not_the_global_batch(runs: Path) -> None:
    hot, cool = [json.loads(x) for x in (runs / "hot" / layout.METRICS).read_text().splitlines()], _steps(runs, "ddp")
    steps = [r for r in hot if "step" in r]
    assert [r["accumulation"] for r in steps] == [2] * 5 + [4] * 5 + [8] * 2
    assert [r["micro_batch"] for r in steps[:-1]] == [32] * 5 + [16] * 5 + [8]  # the epoch's last batch is short
    assert [r["batch"] for r in steps] == [r["batch"] for r in cool] == [128] * 11 + [steps[-1]["batch"]]
    assert {r["temperature_c"] for r in steps} == {90.0}
    assert [bool(r["batch_event"]) for r in steps] == [i in (0, 5, 10) for i in range(12)]
    assert [r["comm_bytes"] for r in steps] == [r["comm_bytes"] for r in cool]  # still one sync per step
    assert steps[-1]["loss"] == pytest.approx(cool[-1]["loss"], rel=0.1)


def test_under_fsdp_one_hot_rank_splits_every_ranks_micro_batch_and_the_run_ends(runs: Path) -> None:
    # Rank 0's log: its own sensor reads 40 °C, rank 1's 90 °C against 80.
    steps = [json.loads(x) for x in (runs / "fsdp-hot" / layout.METRICS).read_text().splitlines() if '"step"' in x]
    assert [r["accumulation"] for r in steps] == [2] * 5 + [4] * 5 + [8] * 2
    assert [r["batch_event"] for r in steps if r["batch_event"]] == [
        f"another rank's heat: accumulation {n}" for n in (2, 4, 8)
    ]
    assert {r["temperature_c"] for r in steps} == {40.0}
    for rank in (0, 1):  # each rank says so, in one line, rather than waiting on the other
        assert (runs / f"fsdp-oom.{rank}").read_text() == (
            "out of memory under FSDP, whose micro-batches every rank runs alike: set train.accumulation = 2 "
            "(or a smaller train.batch_size)"
        )


def _shard_resnet_in_bf16() -> None:
    dist.init_process_group("gloo")
    try:
        cfg = validate({"train": {"strategy": "fsdp", "precision": "bf16-mixed"}}, "test").train
        rt = runtime.Runtime(0, 1, "gloo", torch.device("cpu"), "bf16-mixed")
        model, _ = strategy.wrap(models.build_model("resnet18", 10, 3), cfg, rt, "fsdp")
        with rt.autocast():
            loss = model(torch.zeros(2, 3, 32, 32)).float().sum()
        loss.backward()
        assert model.bn1.weight.grad is not None and model.bn1.weight.dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_fsdp_bf16_shards_a_norm_layer_at_the_root_once() -> None:
    """resnet18's stem BatchNorm is a root child, so both a norm unit and a block: sharded twice, FSDP2 refused."""
    run_ranks(_shard_resnet_in_bf16, world=1)
