"""Two nodes of one job: two `pipeline train --nnodes 2` processes meeting at a c10d rendezvous on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline import layout, train
from pipeline.files import read_json
from pipeline.manifest import RunDir
from tests.train.ranks import free_port
from tests.train.test_stage import STEPS_PER_EPOCH


def test_two_nodes_train_one_job_into_a_shared_run_dir_and_node_zero_records_it(tmp_path: Path) -> None:
    """Both nodes train; a later start of node 1 alone finds the stage cached instead of waiting for node 0."""
    run_dir = tmp_path / "run"
    node = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(run_dir), "--set", "train.epochs=1"]
    node += ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    procs = [
        subprocess.Popen(
            [*node, "--node-rank", str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert "node 1 of 2; node 0 records the run" in outputs[1]

    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["world_size"] == 2 and summary["steps"] == STEPS_PER_EPOCH  # 32 per rank, one rank per node
    recorded = RunDir(run_dir).manifest()["stages"]["train"]
    assert recorded["outputs"] == train.STAGE.outputs and recorded["metrics"]["val_accuracy"] == summary["val_accuracy"]
    latest = run_dir / layout.LATEST
    assert sorted(p.name for p in latest.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]  # a shard from each node

    again = subprocess.run([*node, "--node-rank", "1"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "[train] cached" in again.stdout
