"""`auto`'s choice before training, between DiLoCo for the run and the gradient methods: from measured numbers, and
from a real probe on two gloo ranks."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import models
from pipeline import layout
from pipeline.config import validate
from pipeline.train.compression import auto, autoplan, registry
from pipeline.train.compression.auto import LinkSample
from pipeline.train.compression.method import Epoch
from pipeline.train.rank import runtime
from pipeline.train.rank.worker import Trainer
from tests.train.compression.helpers import method_config, rank_results

CANDIDATES = [m for m in registry.METHODS.values() if m.auto]
WEAK = LinkSample(latency_s=0.24, s_per_byte=8 / 18e6)
"""The cluster benchmark's 4 stand-ins: a 4-byte ring all-reduce in 0.24 s (121 ms between devices), 18 Mbit/s."""
LAN = LinkSample(latency_s=0.0005, s_per_byte=8 / 1e9)
"""Two ranks on one host, as measured by the probe here: 0.5 ms, about 1 Gbit/s."""


def _small_cnn() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = models.build_model("small_cnn", 10, 1)
    return net, [p for p in net.parameters() if p.requires_grad]


def _knobs(net: torch.nn.Module, epoch: Epoch | None = None, **train: object) -> registry.Knobs:
    return registry.knobs(validate({"train": {"compression": "auto", **train}}, "test").train, net, 0, epoch)


def test_diloco_on_the_weak_link_and_the_gradient_methods_on_a_lan() -> None:
    net, params = _small_cnn()
    knobs = _knobs(net)
    weak = autoplan.predict(WEAK, 0.02, params, knobs, 4, CANDIDATES)
    assert set(weak) == {m.name for m in CANDIDATES} | {"diloco"}
    assert autoplan.decide(weak)[0] == "diloco"
    # Twice the epochs at 0.02 s of compute plus an 8-bit all-gather every 8 steps, against a 0.24 s round trip a
    # step at least.
    assert weak["diloco"] < 0.5 * min(s for m, s in weak.items() if m != "diloco")
    lan = autoplan.predict(LAN, 0.03, params, knobs, 2, CANDIDATES)
    method, why = autoplan.decide(lan)
    assert method == autoplan.GRADIENTS and "not 20% faster" in why
    # Compute dominates: DiLoCo's twice the epochs cost about twice the time.
    assert lan["diloco"] == pytest.approx(2 * lan["none"], rel=0.05)


def test_diloco_spreads_its_outer_step_over_the_steps_between_two() -> None:
    """At period 8, an epoch of 12 steps has 2 outer steps (one every 6 steps) and one of 23 has 3: each step
    carries that share of one."""
    net, params = _small_cnn()
    outer = auto.predict(autoplan.outer_cost(params, _knobs(net)), WEAK, 0.0, 4)
    for steps, between in ((8, 8), (12, 6), (23, 23 / 3)):
        predicted = autoplan.predict(WEAK, 0.02, params, _knobs(net, Epoch(steps)), 4, CANDIDATES)
        assert predicted["diloco"] == pytest.approx(2 * (0.02 + outer / between))


def test_diloco_is_weighed_against_the_exact_gradient_methods_alone() -> None:
    """On the cluster benchmark's link with its bandwidth job (mobilenet_v3_small at 32 px, 0.2 s of compute a step)
    a lossy method's step beats DiLoCo's twice the epochs, but learns less an epoch (there `auto`, switching among
    the gradient methods, ended 15 points under `none`): against the exact methods, DiLoCo is chosen."""
    torch.manual_seed(0)
    net = models.build_model("mobilenet_v3_small", 10, 3)
    params, knobs = [p for p in net.parameters() if p.requires_grad], _knobs(net)
    exact = autoplan.compared(CANDIDATES, params, knobs)
    assert [m.name for m in exact] == ["none", "fp16"]
    assert autoplan.decide(autoplan.predict(WEAK, 0.2, params, knobs, 4, CANDIDATES))[0] == autoplan.GRADIENTS
    assert autoplan.decide(autoplan.predict(WEAK, 0.2, params, knobs, 4, exact))[0] == autoplan.DILOCO


def test_one_link_sample_settles_a_clear_choice_and_not_a_close_one() -> None:
    net, params = _small_cnn()
    knobs = _knobs(net)

    def choice(link: LinkSample) -> str:
        return autoplan.decide(autoplan.predict(link, 0.02, params, knobs, 4, CANDIDATES))[0]

    assert autoplan.settled(choice, WEAK) and choice(WEAK) == autoplan.DILOCO
    assert autoplan.settled(choice, LAN) and choice(LAN) == autoplan.GRADIENTS
    # Between them, a link where a factor of 4 changes the choice: there one sample does not settle it.
    factors = [2 ** (-i / 2) for i in range(40)]
    close = next(f for f in factors if choice(WEAK.scaled(f)) != choice(WEAK.scaled(f / 4)))
    assert not autoplan.settled(choice, WEAK.scaled(close))


def test_the_outer_step_in_fp32_costs_four_times_the_bytes() -> None:
    net, params = _small_cnn()
    int8 = autoplan.outer_cost(params, _knobs(net))
    fp32 = autoplan.outer_cost(params, _knobs(net, outer_int8=False))
    numel = sum(p.numel() for p in params)
    assert (int8.payload_bytes, int8.gathers) == (numel + 4 * len(params), True)
    assert (fp32.payload_bytes, fp32.gathers) == (4 * numel, False)


def test_timing_a_step_leaves_the_model_as_it_was() -> None:
    net, _ = _small_cnn()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(8, 1, 16, 16), torch.arange(8)
    assert autoplan.time_step(net, x, y, contextlib.nullcontext) > 0
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm's running statistics included
    assert all(p.grad is None for p in net.parameters())


def _forced_diloco(predicted: dict[str, float], band: float = 0.2) -> tuple[str, str]:
    return autoplan.DILOCO, "forced by the test"


def probe_then_resume(root: Path) -> None:
    """On each rank: the probe on the digits' model with a batch of the rank's own size; then an `auto` run of one
    epoch whose choice the test forces to DiLoCo (which trains it 2), resumed for a second (4) with the choice left to
    the probe."""
    rt = runtime.init(validate({}, "test").train)
    try:
        net, _ = _small_cnn()
        rank = dist.get_rank()
        # Rank 1's batch is twice rank 0's: its step is slower, and its time must count on both ranks.
        size = 8 * (1 + rank)
        batch = torch.randn(size, 1, 16, 16), torch.arange(size) % 10
        choice = autoplan.probe(net, batch, _knobs(net), CANDIDATES, rt.autocast)
        summaries = []
        for epochs, decide in ((1, _forced_diloco), (2, autoplan.decide)):
            autoplan.decide = decide  # type: ignore[assignment]
            summaries.append(Trainer(method_config("auto", epochs, 256), root / "run", rt).fit())
        (root / f"rank{rank}.json").write_text(json.dumps({"probe": choice.record(), "summaries": summaries}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """What each rank wrote (one spawn for the module's tests), and the root of its run directory."""
    root = tmp_path_factory.mktemp("autoplan")
    return root, rank_results(probe_then_resume, root)


def test_every_rank_probes_alike_from_the_slowest_ranks_numbers(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    probes = [r["probe"] for r in ranks[1]]
    same = ("method", "reason", "latency_ms", "mbit_per_s", "compute_s", "predicted_s")
    assert [{k: p[k] for k in same} for p in probes] == [{k: probes[1][k] for k in same}] * 2
    assert probes[0]["method"] == autoplan.GRADIENTS  # one host: the link is no bottleneck
    assert probes[0]["compute_s"] > 0 and probes[0]["probe_s"] > 0
    # One host: the first link sample settles it. Its bytes count against auto's.
    assert probes[0]["link_samples"] == 1
    assert probes[0]["probe_bytes"] == 8 + 512 * 1024 + 20


def test_a_resumed_run_keeps_the_choice_its_checkpoint_records(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = ranks
    first, resumed = results[0]["summaries"]
    assert first["compression_choice"]["reason"] == "forced by the test"
    # Resumed, the probe would choose the gradient methods on one host: the checkpoint's DiLoCo runs on.
    assert resumed["compression_choice"]["method"] == autoplan.DILOCO
    assert resumed["compression_choice"]["reason"] == "as the checkpoint resumed from recorded"
    for summary, epochs in ((first, 2), (resumed, 4)):
        assert summary["compression"] == "auto" and set(summary["compression_seconds"]) == {"diloco"}
        assert summary["epochs"] == epochs  # a set count is the plain run's: DiLoCo trains twice it
    # DiLoCo's outer momentum is in every checkpoint, for the resumed run to go on with.
    steps = sorted((root / "run" / layout.CHECKPOINTS).glob("step-*"))
    assert steps and all(json.loads((s / "trainer.json").read_text())["outer_state"] for s in steps)
    lines = [json.loads(x) for x in (root / "run" / layout.METRICS).read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert len(steps) == 24 and {r["compression"] for r in steps} == {"diloco"}
    # 6 steps an epoch, period 8: DiLoCo sends only at its outer steps, one an epoch at its last step (the resumed
    # run too): never a gradient.
    assert [r["step"] for r in steps if r["comm_bytes"]] == [6, 12, 18, 24]
