"""`compression = "auto"`: its decisions as pure functions of measured numbers, and on two real gloo ranks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import models
from pipeline import layout
from pipeline.config import validate
from pipeline.train.compression import auto, registry, sign, sparse, topk
from pipeline.train.compression.auto import WINDOW, Cost, Decision, LinkSample, LinkWatch, Policy, predict
from pipeline.train.compression.method import CommCounter, CountingState
from pipeline.train.rank import runtime
from pipeline.train.rank.worker import Trainer
from tests.train.ranks import run_ranks

# resnet18-like numbers: 45 MB of gradients, 0.25 s of compute; PowerSGD sends 0.6 MB, top-k 0.9 MB, sign 1.4 MB.
COSTS = [
    Cost("none", 44_700_000, 0.0),
    Cost("fp16", 22_350_000, 0.03),
    Cost("powersgd", 620_000, 0.08, rounds=3),
    Cost("topk", 890_000, 0.35, gathers=True),
    Cost("sign", 1_400_000, 0.55, gathers=True),
]
CANDIDATES = [m for m in registry.METHODS.values() if m.auto]
LOOPBACK = LinkSample(latency_s=0.0002, s_per_byte=1 / 2e9)  # 16 Gbit/s
WEAK = LinkSample(latency_s=0.045, s_per_byte=1 / 12e6)  # ~100 Mbit/s, 40 ms RTT
COMPUTE = 0.25


def test_a_link_sample_is_latency_plus_a_rate() -> None:
    sample = LinkSample.from_timings(0.01, 0.01 + 0.5, 1_000_004)
    assert sample.latency_s == 0.01
    assert sample.s_per_byte == pytest.approx(0.5 / 1_000_000)
    assert sample.mbit_per_s == pytest.approx(16.0)


def test_prediction_adds_compute_encoding_round_trips_and_bytes() -> None:
    link = LinkSample(0.01, 1e-6)
    assert predict(Cost("powersgd", 1000, 0.1, rounds=3), link, 1.0, 2) == pytest.approx(1.0 + 0.1 + 3 * 0.01 + 1000e-6)
    # An all_gather receives every other rank's payload: twice a 2-rank all-reduce's share at 4 ranks.
    assert predict(Cost("topk", 1000, 0.0, gathers=True), link, 0.0, 4) == pytest.approx(0.01 + 2 * 1000e-6)


def test_first_decision_picks_the_fastest_for_the_link() -> None:
    fast = Policy(world=2).observe(10, [LOOPBACK] * 3, COMPUTE, COSTS)
    weak = Policy(world=2).observe(10, [WEAK] * 3, COMPUTE, COSTS)
    assert (fast.method, fast.previous, fast.switched) == ("none", None, True)
    assert weak.method == "powersgd"
    assert weak.predicted_s["powersgd"] < weak.predicted_s["none"] / 5
    assert "powersgd" in weak.line() and "Mbit/s" in weak.line()


def test_noisy_samples_do_not_switch() -> None:
    policy = Policy(world=2)
    policy.observe(10, [LOOPBACK] * 3, COMPUTE, COSTS)
    # Stalls at every other measurement: the window's median turns weak now and then, never twice in a row.
    decisions = [policy.observe(10 + 20 * i, [WEAK if i % 2 else LOOPBACK], COMPUTE, COSTS) for i in range(1, 9)]
    assert all(d.method == "none" and not d.switched for d in decisions)
    assert any("(1/2)" in d.reason for d in decisions)


def test_a_lasting_change_switches_after_patience_measurements() -> None:
    policy = Policy(world=2)
    compute = 0.1  # PowerSGD's 0.08 s of encoding is then well outside the band on loopback
    policy.observe(10, [LOOPBACK] * 3, compute, COSTS)
    seen = [policy.observe(step, [WEAK], compute, COSTS) for step in (30, 50, 70)]
    # The median of 3 turns weak at the second weak sample; then 2 measurements in a row must agree.
    assert [d.method for d in seen] == ["none", "none", "powersgd"]
    assert "(1/2)" in seen[1].reason and seen[2].switched and seen[2].previous == "none"
    back = [policy.observe(step, [LOOPBACK], compute, COSTS) for step in (90, 110, 130)]
    assert [d.method for d in back] == ["powersgd", "powersgd", "none"]
    # With 0.25 s of compute, none is only 18% faster on loopback: inside the band, PowerSGD stays.
    policy.current = "powersgd"
    assert policy.observe(150, [LOOPBACK] * 3, COMPUTE, COSTS).method == "powersgd"


def test_a_gain_inside_the_band_does_not_switch() -> None:
    policy = Policy(world=2, band=0.2)
    costs = [Cost("none", 1_000_000, 0.0), Cost("fp16", 500_000, 0.0)]
    link = LinkSample(0.0, 0.1 / 1_000_000)  # none 1.1 s, fp16 1.05 s: 5% faster
    policy.current = "none"
    decisions = [policy.observe(s, [link] * 3, 1.0, costs) for s in range(5)]
    assert all(d.method == "none" and "within 20%" in d.reason for d in decisions)


def test_the_link_is_sampled_again_only_when_the_hooks_time_moves_or_to_recheck() -> None:
    watch = LinkWatch(band=0.2, floor_s=0.005, recheck=3)
    assert watch.due(0.100)[0] == 0  # the first measurement of a method sets its baseline
    assert [watch.due(s)[0] for s in (0.110, 0.090, 0.104)] == [0, 0, 1]  # within 20%: only the re-check
    count, why = watch.due(0.300)  # the link slowed: the running method's own collectives tell
    assert count == WINDOW and "100.0 -> 300.0 ms/step" in why
    assert watch.due(0.310)[0] == 0  # the new level is the new baseline
    assert watch.due(0.200)[0] == WINDOW  # and a faster link is a move too
    tiny = LinkWatch(band=0.2, floor_s=0.005)
    tiny.due(0.001)
    assert tiny.due(0.004)[0] == 0  # 3 ms on a loopback link is noise, not a new link


def test_payload_model_matches_what_the_hooks_count() -> None:
    params = list(models.build_model("small_cnn", 10, 1).parameters())
    numel = sum(p.numel() for p in params)
    cfg = validate({"train": {"compression": "auto", "powersgd_rank": 4}}, "test").train
    knobs = registry.knobs(cfg, models.build_model("small_cnn", 10, 1), 0)
    payload = {m.name: m.payload_bytes(params, knobs) for m in CANDIDATES if m.payload_bytes}
    assert payload["none"] == 4 * numel
    assert payload["topk"] == 8 * topk.size(numel, 0.1)
    # The same sizes tests/train/compression/test_registry.py checks against every hook's counted bytes.
    assert payload["sign"] == sign.size(params)


def test_encoding_costs_are_measured_for_every_candidate() -> None:
    model = models.build_model("small_cnn", 10, 1)
    params = list(model.parameters())
    knobs = registry.knobs(validate({"train": {"compression": "auto"}}, "test").train, model, 0)
    # The compressors divide by the group's size: a one-rank group in this process (they do not communicate here).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        costs = {m.name: auto.encode_seconds(m, params, knobs, 2) for m in CANDIDATES}
    finally:
        dist.destroy_process_group()
    assert costs["none"] == 0.0
    assert all(s > 0 for m, s in costs.items() if m != "none")


SCRIPT = ["sign", "powersgd", "topk", "fp16", "none", "powersgd", "sign", "topk"]
_OBSERVE = Policy.observe


def _scripted(order: Iterator[str]) -> Callable[..., Decision]:
    """Policy.observe measuring as usual, but deciding the next method of `order` at every measurement."""

    def observe(self: Policy, step: int, samples: list[LinkSample], compute_s: float, costs: list[Cost]) -> Decision:
        decision = _OBSERVE(self, step, samples, compute_s, costs)
        self.current = next(order)
        return dataclasses.replace(decision, method=self.current, reason="scripted")

    return observe


def train_auto(root: Path, scripted: bool) -> None:
    """On each rank: the digits with `auto` for 2 epochs, measuring every 5 steps; each rank writes its decisions
    and a checksum of its weights. `scripted`: rank 0's policy cycles through every candidate instead of choosing,
    so every switch (and its carried error feedback) happens on real collectives."""
    if scripted:
        Policy.observe = _scripted(iter(SCRIPT))  # type: ignore[method-assign]
    cfg = validate({"train": {"epochs": 2, "compression": "auto", "compression_auto_every_steps": 5}}, "test")
    rt = runtime.init(cfg.train)
    try:
        trainer = Trainer(cfg, root, rt)
        summary = trainer.fit()
        weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        record = {"decisions": trainer.comm.decisions, "weights": weights.double().sum().item(), "summary": summary}
        (root / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[False, True], ids=["chosen", "scripted"])
def auto_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("auto")
    run_ranks(train_auto, root, request.param)
    return root


@pytest.mark.slow
def test_auto_records_decisions_that_every_rank_follows(auto_run: Path) -> None:
    ranks = [json.loads((auto_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    lines = [json.loads(x) for x in (auto_run / layout.METRICS).read_text().splitlines()]
    decided = [r for r in lines if "compression_decision" in r]
    # 23 steps an epoch: warm-up is the first epoch, then a measurement at step 23 and every 5 steps after it.
    assert [r["step"] for r in decided] == [23, 28, 33, 38, 43]
    chosen = [[r["step"], r["compression_decision"]["method"]] for r in decided]
    assert ranks[0]["decisions"] == ranks[1]["decisions"] == chosen
    for r in decided:
        d = r["compression_decision"]
        assert d["mbit_per_s"] > 0 and d["compute_s"] > 0 and set(d["predicted_s"]) == {m.name for m in CANDIDATES}
    # Each step line names the method that ran it; the summary adds up their wall time.
    steps = [r for r in lines if "step" in r and "loss" in r]
    assert all(r["compression"] == "none" for r in steps if r["step"] <= 23)
    ran = {r["compression"] for r in steps}
    assert set(ranks[0]["summary"]["compression_seconds"]) == ran
    # Identical averaged gradients on both ranks, whatever ran: identical weights.
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["summary"]["val_accuracy"] >= 0.7  # 2 epochs: `none` itself reaches about 0.8


def test_switching_carries_what_error_feedback_has_not_sent() -> None:
    state = sparse.SparseState(None, CommCounter(), sparse.Steps(0))
    state.residuals[0] = torch.ones(5)
    assert torch.equal(registry.METHODS["topk"].residuals(state)[0], torch.ones(5))
    ddp_state = CountingState(None, CommCounter())
    assert registry.METHODS["none"].residuals(ddp_state) == {}  # plain all-reduce sends everything
