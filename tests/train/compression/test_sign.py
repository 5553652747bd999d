"""`sign`: bit packing, per-channel scales, and what two real gloo ranks average."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

import models
from pipeline.config import validate
from pipeline.train.compression import sign
from pipeline.train.rank import runtime, strategy
from tests.train.compression.helpers import method_config, rank_results


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


def test_sign_sends_a_bit_per_entry_a_scale_per_row_and_small_tensors_whole() -> None:
    signed, vector, small = torch.zeros(64, 32), torch.zeros(17), torch.zeros(10, 50)
    assert sign.size([signed]) == 2048 // 8 + 4 * 64
    assert sign.size([signed, vector, small]) == 2048 // 8 + 4 * 64 + 4 * (17 + 500)
    resnet = list(models.build_model("resnet18", 10, 3).parameters())
    assert sign.size(resnet) < 4 * sum(p.numel() for p in resnet) / 30


def test_sign_packing_round_trips_and_is_one_bit_per_entry() -> None:
    x = torch.randn(1001)
    x[3] = 0.0
    packed = sign.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 / 8)
    signs = sign.unpack_signs(packed, 1001)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))


def test_scaled_signs_are_each_rows_scale_times_its_signs() -> None:
    shapes = [torch.Size([7, 1]), torch.Size([1, 3]), torch.Size([3, 100]), torch.Size([2, 2, 5])]
    x = torch.randn(sum(s.numel() for s in shapes))
    scales = sign.row_scales(list(x.split([s.numel() for s in shapes])), shapes)
    assert scales.numel() == 7 + 1 + 3 + 2
    row_sizes = [s.numel() // s[0] for s in shapes for _ in range(s[0])]
    expected = scales.repeat_interleave(torch.tensor(row_sizes)) * torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(sign.scaled_signs(sign.pack_signs(x), scales, shapes), expected)
    assert scales[0] == x[0].abs()  # the first tensor's rows are single entries
