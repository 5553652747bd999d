"""The nightly-cluster deployment as people run it (a real local Prefect server, a process worker), training on
stand-in Jetsons over SSH: cancelling its flow run through Prefect's API stops the ranks on every device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.cluster.test_cluster import forwarding, inventory, jetson_fleet, marked_processes, start_cluster

__all__ = ["forwarding", "jetson_fleet"]  # fixtures, used by name
REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def prefect(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def wait_until(what: str, done, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s}s"
        time.sleep(1)


@pytest.mark.slow
def test_cancelling_the_flow_run_stops_training_on_every_device(
    prefect_env: dict[str, str], jetson_fleet, forwarding, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 3)
    inv = inventory(fleet)
    overrides = [
        f"train.inventory={json.dumps(str(inv))}",
        "train.epochs=200",
        f"run.runs_root={tmp_path / 'runs'}",
        f'deploy.targets=[{{name="edge", root="{tmp_path / "device"}"}}]',
    ]
    created = prefect(prefect_env, "deployment", "run", "train-to-deploy/nightly-cluster", "--params",
                      json.dumps({"overrides": overrides}))  # fmt: skip
    (run_id,) = set(UUID.findall(created))
    # An agent and a rank on each of the three devices: the flow's train task is training on the cluster.
    wait_until("training on every device", lambda: len(marked_processes(fleet)) >= 6)
    prefect(prefect_env, "flow-run", "cancel", run_id)
    wait_until(
        "the flow run to be cancelled", lambda: "CANCELLED" in prefect(prefect_env, "flow-run", "inspect", run_id)
    )
    wait_until("no training process on any device", lambda: marked_processes(fleet) == [], timeout_s=60)
    assert all(target.running for target in fleet)  # the devices are up: their processes were stopped, not them
