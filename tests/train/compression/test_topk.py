"""`topk`: its default fraction, and the fast selection that must pick what `torch.topk` picks."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.compression import topk


def test_default_fraction_scales_with_the_model() -> None:
    assert topk.default_fraction(20_234) == 0.1  # small_cnn: 2023 entries
    assert topk.default_fraction(11_181_642) == 0.01  # resnet18: 111,817 entries
    assert topk.default_fraction(200_000) == pytest.approx(2048 / 200_000)


def _magnitudes() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    heavy = torch.randn(200_000, generator=generator).abs() * torch.rand(200_000, generator=generator) ** 3
    strided = torch.rand(20_000, generator=generator)
    strided[:: topk.SAMPLE_STRIDE] += 10.0  # the sample sees only these: its threshold keeps too few
    return {"heavy-tailed": heavy, "strided": strided, "ties": torch.ones(50_000), "small": torch.rand(300)}


@pytest.mark.parametrize("name", ["heavy-tailed", "strided", "ties", "small"])
@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.1, 0.6])
def test_largest_selects_what_topk_selects(name: str, fraction: float) -> None:
    magnitude = _magnitudes()[name]
    k = topk.size(magnitude.numel(), fraction)
    index = topk.largest(magnitude, k)
    assert index.numel() == k and index.unique().numel() == k
    # The same values as topk's (ties may pick other entries of equal magnitude).
    expected = magnitude.topk(k).values
    assert torch.equal(magnitude[index].sort(descending=True).values, expected)
