"""Devices as NVIDIA ships them: stand-in devices whose Python is 3.10 and whose torch is 2.5 (JetPack 6) train with
a controller on this machine's newer Python and torch, and the controller consolidates and exports what they wrote.

The devices' interpreter is `.venv-oldest` (tests/requirements-oldest.txt), which `make test-oldest` (run by
`make test`) builds; everything else is tests/train/cluster/test_cluster.py's stand-in cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from pipeline import layout
from pipeline.files import read_json
from pipeline.train.rank import checkpoint
from tests.harness import fixtures
from tests.train.cluster.test_cluster import REPO, forwarding, inventory, marked_processes, run_cli, start_cluster
from tests.train.cluster.test_federated import run_chain
from tests.train.cluster.test_security import run_attacked_job

jetson_fleet = fixtures.jetson_fleet
OLDEST = Path(os.environ.get("PIPELINE_OLDEST_PYTHON", REPO / ".venv-oldest/bin/python"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not OLDEST.exists(), reason=f"no {OLDEST}: `make test-oldest` builds it"),
]
__all__ = ["forwarding"]  # a fixture this module uses by name


def test_python_3_10_and_torch_2_5_devices_train_and_the_controller_goes_on(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    base = subprocess.run([OLDEST, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True)
    fleet = start_cluster(jetson_fleet, 2, oldest=base.stdout.strip())
    inv = inventory(fleet, node_1={"python": str(OLDEST)}, node_2={"python": str(OLDEST)})
    check = run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    rows = json.loads(check.stdout)
    assert [(r["status"], r["python"][:5], r["torch"][:4]) for r in rows] == [("ready", "3.10.", "2.5.")] * 2, rows
    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), "--set", "train.epochs=3", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["world_size"] == 2 and summary["val_accuracy"] >= 0.9, summary
    for target in fleet:  # each device committed whole checkpoints of its own, not only rank 0's (_save_alone)
        [device_run] = (target.disk / "train/runs").iterdir()
        pointer = device_run / layout.CHECKPOINTS / checkpoint.LATEST  # a relative link: read, not resolved (harness)
        newest = pointer.parent / os.readlink(pointer)
        assert (newest / checkpoint.TRAINER_JSON).is_file(), target.name
        files = dcp.FileSystemReader(newest).read_metadata().storage_data.values()
        assert {f.relative_path for f in files} == {"__0_0.distcp"}, target.name
    for stage in ("consolidate", "export"):  # the controller's torch reads the checkpoint torch 2.5 wrote
        done = run_cli(stage, "--run-dir", str(run_dir), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    # FSDP2 before torch 2.6 needs CUDA: refused before anything starts, not a crash in every rank.
    fsdp = run_cli("train", "--inventory", str(inv), "--run-dir", str(tmp_path / "fsdp"),
                   "--set", "train.strategy=fsdp", cwd=tmp_path)  # fmt: skip
    assert fsdp.returncode == 2 and fsdp.stderr.strip().splitlines() == [
        "error: node-1: refused: train.strategy=fsdp needs a GPU with torch 2.5.1+cu124 "
        "(its FSDP2 runs on a CPU from torch 2.6); use ddp"
    ], fsdp.stderr
    assert marked_processes(fleet) == []


def test_on_python_3_10_devices_an_attacker_reaches_no_store_and_nothing_leaks(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    """tests/train/cluster/test_security.py's attacks, on devices with torch 2.5 (whose TCPStore serves a socket
    handed to it only with its legacy backend)."""
    run_attacked_job(jetson_fleet, tmp_path, str(OLDEST))


def test_on_python_3_10_devices_federated_training_runs_with_flower_1_30(jetson_fleet, tmp_path: Path) -> None:
    """JetPack 6's Python 3.10 has Flower 1.30 at most: its clients train with the controller's newer Flower server."""
    run_chain(jetson_fleet, tmp_path, str(OLDEST))
