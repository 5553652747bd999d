"""`powersgd`: the payload model against an analytic count, and the models it refuses."""

from __future__ import annotations

import pytest
import torch

import models
from pipeline.errors import PipelineError
from pipeline.train.compression import powersgd, registry
from tests.train.compression.helpers import method_config, small_cnn_params


def analytic_numel(params: list[torch.Tensor], rank: int) -> int:
    """Elements PowerSGD sends: P (n x r) and Q (m x r) per matrix worth compressing, the rest as they are."""
    total = 0
    for p in params:
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if p.dim() > 1 and n * m > 2 * (n + m) * r else p.numel()
    return total


def test_sent_numel_matches_the_analytic_count() -> None:
    params = small_cnn_params()
    assert powersgd.sent_numel([p.shape for p in params], 4) == analytic_numel(params, 4)


def test_powersgd_is_refused_where_no_matrix_shrinks() -> None:
    cfg = method_config("powersgd", 1, 2, compression_warmup_steps=2).train
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(PipelineError, match=r"^train.compression 'powersgd': no weight matrix .* rank 8"):
        registry.knobs(cfg, tiny, 2)
    assert registry.knobs(cfg, models.build_model("small_cnn", 10, 1), 2).warmup_steps == 2
