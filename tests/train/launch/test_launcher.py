"""The launcher without torchrun: command line, environment, up-front checks, and stopping a process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.config import validate
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.manifest import create_run_dir
from pipeline.train.launch import launcher
from pipeline.train.launch.topology import Topology
from pipeline.train.rank import checkpoint


def test_command_runs_the_worker_module_under_torchrun() -> None:
    node_1 = Topology(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", nproc_per_node=4, local_addr="10.0.0.2")
    cmd = launcher.command(Path("/runs/r1"), node_1, max_restarts=3)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = cmd[3:]
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--nproc-per-node"] == "4"
    assert pairs["--nnodes"] == "2"
    assert pairs["--node-rank"] == "1"
    assert pairs["--rdzv-backend"] == "c10d"
    assert pairs["--rdzv-endpoint"] == "10.0.0.1:29500"
    assert pairs["--max-restarts"] == "3"
    assert pairs["--local-addr"] == "10.0.0.2"
    # No agent hosts the rendezvous store, the node at the endpoint included: its launcher does, bound to one address.
    assert pairs["--rdzv-conf"] == "is_host=0"
    assert cmd[-4:] == ["-m", "pipeline.train.rank.worker", "--run-dir", "/runs/r1"]


def test_environment_pins_threads_and_store_behaviour() -> None:
    net = {"GLOO_SOCKET_IFNAME": "wlan0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    env = launcher.environment(validate({"train": {"threads_per_rank": 3, "env": net}}, "test").train, True)
    assert env["GLOO_SOCKET_IFNAME"] == "wlan0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["OMP_NUM_THREADS"] == "3"
    # The ranks import the installed package, so nothing points them at a source tree.
    assert env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    # One host's gloo listens on loopback, unless the user named an interface; several hosts need the network.
    assert launcher.environment(validate({}, "test").train, True)["GLOO_SOCKET_IFNAME"] == "lo"
    several = launcher.environment(validate({}, "test").train, False)
    assert several.get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"nnodes": 2}, "--rdzv-endpoint"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank"),
        ({"nproc_per_node": 0}, "--nproc-per-node"),
        ({"nproc_per_node": 4096}, r"--nproc-per-node: 4096 ranks, but this node has \d+ (CPU cores|GPUs)"),
    ],
)
def test_bad_topology_is_rejected_before_anything_starts(tmp_path: Path, kwargs: dict, flag: str) -> None:
    with pytest.raises(PipelineError, match=flag):
        launcher.launch(validate({}, "test"), tmp_path, Topology(**kwargs))
    assert list(tmp_path.iterdir()) == []


def test_preflight_names_the_offending_key(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match=r"data\.image_size: 16 is below resnet18"):
        launcher.preflight(validate({"model": {"name": "resnet18"}}, "test"))
    with pytest.raises(PipelineError, match=r"model\.weights: .*missing\.safetensors"):
        launcher.preflight(validate({"model": {"weights": str(tmp_path / "missing.safetensors")}}, "test"))
    with pytest.raises(PipelineError, match=r"model\.name"):
        launcher.preflight(validate({"model": {"name": "nope"}}, "test"))


def test_nccl_without_cuda_is_refused_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hides a GPU where there is one
    with pytest.raises(PipelineError, match=r"train\.backend: nccl needs CUDA, which this node does not have"):
        launcher.launch(validate({"train": {"backend": "nccl", "nproc_per_node": 1}}, "test"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_checkpoint_is_refused_before_the_snapshot_changes(tmp_path: Path) -> None:
    first = validate({}, "test")
    run = create_run_dir(first, tmp_path / "run")
    meta = {"epoch": 0, "step": 3, "resume_key": checkpoint.resume_key(first)}
    write_json(run.path / layout.CHECKPOINTS / "step-3" / checkpoint.TRAINER_JSON, meta)
    (run.path / layout.LATEST).symlink_to("step-3")
    with pytest.raises(PipelineError, match="written for a different data/model config"):
        launcher.launch(validate({"model": {"name": "resnet18"}, "data": {"image_size": 32}}, "test"), run.path)
    assert run.load_config() == first


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        # digits has ~1,400 training images: a global batch of 5,000 is refused before any rank starts.
        ("train.batch_size=5000", "error: train.batch_size: 5000 is larger than the training split (1437 images"),
        # The compression registry's names are the accepted ones.
        ("train.compression=gzip", "error: train.compression: 'gzip' is not a method (one of: none, star, fp16, "),
    ],
)
def test_a_config_that_cannot_train_is_one_line_before_any_rank(tmp_path: Path, setting: str, error: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "train", "--run-dir", "run", "--set", setting],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(error)
    assert not (tmp_path / "run/train").exists()
