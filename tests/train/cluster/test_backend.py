"""Which process-group backend the ranks use, from what each device's torch has (docs/torch-distributed.md
#no-nccl-on-jetson): NVIDIA's torch for JetPack has no NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.fleet import devicecheck
from pipeline.fleet.inventory import SshTarget
from pipeline.train.cluster import NodeCheck, choose_backend, problems
from pipeline.train.rank import runtime, strategy

SERVER = {"torch": "2.15.0+cu132", "gpu": "NVIDIA H100", "backends": ["gloo", "nccl"]}
ORIN = {"torch": "2.5.0a0+872d972e41.nv24.08", "gpu": "Orin", "backends": ["gloo"]}
CPU_BOARD = {"torch": "2.5.1", "gpu": "", "backends": ["gloo"]}


def nodes(*facts: dict[str, object]) -> list[NodeCheck]:
    return [NodeCheck(SshTarget(name=f"node-{i}", host="127.0.0.1"), "ready", dict(f)) for i, f in enumerate(facts, 1)]


def test_the_fleet_agrees_on_nccl_only_where_every_device_has_it() -> None:
    assert choose_backend(nodes(SERVER, SERVER), "auto") == "nccl"
    assert choose_backend(nodes(SERVER, ORIN), "auto") == "gloo"  # a Jetson's torch: GPU, no NCCL
    assert choose_backend(nodes(SERVER, CPU_BOARD), "auto") == "gloo"  # mixed: one backend for every rank
    assert choose_backend(nodes(SERVER, SERVER), "gloo") == "gloo"
    with pytest.raises(PipelineError) as err:
        choose_backend(nodes(SERVER, ORIN), "nccl")
    assert str(err.value) == (
        "train.backend: nccl, but node-2 runs torch 2.5.0a0+872d972e41.nv24.08, built without NCCL (as NVIDIA's "
        "torch for JetPack is); use gloo or auto"
    )
    with pytest.raises(PipelineError, match=r"^train\.backend: nccl, but node-1 has no GPU; use gloo or auto$"):
        choose_backend(nodes(CPU_BOARD), "nccl")


def test_a_torch_without_torch_distributed_is_refused_at_the_check() -> None:
    facts = {"python": "3.10.12", "torch": "2.5.0a0+872d972e41.nv24.08", "backends": [], "code_version": "v"}
    assert problems(facts, "v", "python3") == ["torch 2.5.0a0+872d972e41.nv24.08 was built without torch.distributed"]
    assert problems(facts | {"backends": ["gloo"]}, "v", "python3") == []


def test_the_device_check_reports_the_backends_this_torch_has() -> None:
    found = devicecheck.report("/")["backends"]
    assert "gloo" in found and ("nccl" in found) == dist.is_nccl_available()


def test_one_host_follows_its_torch_and_the_clusters_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    train = validate({}, "test").train
    assert runtime.resolve_backend(train) == "gloo"  # no CUDA here
    with pytest.raises(PipelineError, match=r"^train\.backend: nccl needs CUDA"):
        runtime.resolve_backend(train.model_copy(update={"backend": "nccl"}))
    monkeypatch.setenv(runtime.BACKEND_ENV, "gloo")  # what the cluster agreed on wins
    assert runtime.resolve_backend(train.model_copy(update={"backend": "nccl"})) == "gloo"
    monkeypatch.delenv(runtime.BACKEND_ENV)
    # A Jetson: CUDA, and a torch without NCCL (stand-ins for what this machine has not).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert runtime.resolve_backend(train) == "gloo"
    with pytest.raises(PipelineError, match=r"^train\.backend: nccl, but torch .* was built without NCCL"):
        runtime.resolve_backend(train.model_copy(update={"backend": "nccl"}))


def test_fsdp_on_a_gpu_under_gloo_is_refused_before_anything_is_sharded() -> None:
    train = validate({"train": {"strategy": "fsdp"}}, "test").train
    rt = runtime.Runtime(0, 2, "gloo", torch.device("cuda", 0), "fp32")
    with pytest.raises(PipelineError, match=r"^train\.strategy=fsdp: on a GPU it needs the nccl backend"):
        strategy.choose(torch.nn.Linear(2, 2), torch.zeros(1, 2), 8, train, rt)
