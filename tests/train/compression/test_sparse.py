"""The all_gather methods (top-k, sign) over several DDP buckets on two real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import models
from pipeline.config import validate
from pipeline.train.rank import runtime, strategy
from tests.train.compression.helpers import method_config
from tests.train.ranks import run_ranks


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
