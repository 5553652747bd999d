"""The nightly-cluster and nightly-federated deployments as people run them (a real local Prefect server, a process
worker), training on stand-in Jetsons over SSH: cancelling the flow run through Prefect's API stops the ranks, or the
Flower clients, on every device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.digit_folders import write_digit_folders
from tests.harness import JetsonFleet
from tests.train.cluster.test_cluster import forwarding, inventory, jetson_fleet, marked_processes, start_cluster
from tests.train.cluster.test_federated import WHERE

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


def run_and_cancel(
    prefect_env: dict[str, str], deployment: str, fleet: JetsonFleet, overrides: list[str], processes: int
) -> None:
    """Run `deployment` with `overrides`; once `processes` training processes run on the devices, cancel it."""
    created = prefect(prefect_env, "deployment", "run", f"train-to-deploy/{deployment}", "--params",
                      json.dumps({"overrides": overrides}))  # fmt: skip
    (run_id,) = set(UUID.findall(created))
    wait_until("training on every device", lambda: len(marked_processes(fleet)) >= processes)
    prefect(prefect_env, "flow-run", "cancel", run_id)
    wait_until(
        "the flow run to be cancelled", lambda: "CANCELLED" in prefect(prefect_env, "flow-run", "inspect", run_id)
    )
    wait_until("no training process on any device", lambda: marked_processes(fleet) == [], timeout_s=60)
    assert all(target.running for target in fleet)  # the devices are up: their processes were stopped, not them


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
    # An agent and a rank on each of the three devices: the flow's train task is training on the cluster.
    run_and_cancel(prefect_env, "nightly-cluster", fleet, overrides, 6)


@pytest.mark.slow
def test_cancelling_the_federated_flow_run_stops_every_flower_client(
    prefect_env: dict[str, str], jetson_fleet, forwarding, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 3)
    write_digit_folders([t.disk / "digits" for t in fleet], alpha=0.5)
    reference = tmp_path / "reference"
    write_digit_folders([reference], alpha=1000.0)
    inv = json.dumps(str(inventory(fleet)))
    overrides = [
        f"train.inventory={inv}",
        f"deploy.inventory={inv}",
        f"data.path={json.dumps(WHERE)}",
        f"data.reference={json.dumps(str(reference))}",
        "data.image_size=8",
        "train.federated.rounds=200",
        f"run.runs_root={tmp_path / 'runs'}",
    ]
    # A Flower client on each of the three devices: the flow's train task is training the cameras.
    run_and_cancel(prefect_env, "nightly-federated", fleet, overrides, 3)
