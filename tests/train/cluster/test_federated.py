"""Federated training (`train.mode = "federated"`) against stand-in cameras (tests/harness): real sshd per device,
each with a private disk holding its own digits (a Dirichlet label skew), Flower's real server on the controller and
a real Flower client on each device, reached through the device's SSH connection.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.files import read_json
from tests.digit_folders import write_digit_folders
from tests.harness import JetsonTarget
from tests.train.cluster.test_cluster import (
    inventory,
    jetson_fleet,
    marked_processes,
    pipeline_cmd,
    run_cli,
    start_cluster,
)

__all__ = ["jetson_fleet"]  # a fixture, used by name

WHERE = "/opt/edge/digits"
"""Each device's own images: the same path on every private disk; the controller has no such folder."""
FEDERATED = (
    *("--set", "train.mode=federated", "--set", "data.source=imagefolder", "--set", f"data.path={json.dumps(WHERE)}"),
    *("--set", "data.image_size=8", "--set", "data.augment=false", "--set", "model.name=small_cnn"),
    *("--set", "train.federated.min_devices=2", "--set", "train.federated.lr=0.003"),
)


def rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()]


def sent_by(target: JetsonTarget) -> int:
    """Bytes the stand-in has sent on its link so far (the host end's receive counter)."""
    assert target.link is not None
    return int(Path(f"/sys/class/net/{target.link.host_if}/statistics/rx_bytes").read_text())


def run_chain(jetson_fleet, tmp_path: Path, python: str | None = None) -> None:
    """Three cameras (whose interpreter is `python`, this venv's by default) train four rounds on their own skewed
    digits; consolidate and export take the result as they take any run's."""
    extra_dirs = {"python": subprocess.check_output([python, "-c", "import sys; print(sys.base_prefix)"], text=True)
                  .strip()} if python else {}  # fmt: skip
    fleet = start_cluster(jetson_fleet, 3, **extra_dirs)
    write_digit_folders([t.disk / "digits" for t in fleet], alpha=0.5, size=96)  # frames, scaled to 8 px to train
    inv = inventory(fleet, **({t.name.replace("-", "_"): {"python": python} for t in fleet} if python else {}))
    run_dir = tmp_path / "run"
    args = ("--set", "train.federated.rounds=4", "--set", "train.federated.local_epochs=2")
    before = {t.name: sent_by(t) for t in fleet}
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), *FEDERATED, *args, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not Path(WHERE).exists()  # no image was ever on the controller
    # Everything each camera sent during the run (SSH, Flower, TLS, its log lines: its link's own byte counter) is
    # less than a tenth of its image files: no copy of its frames can have left it.
    for t in fleet:
        frames = sum(f.stat().st_size for f in (t.disk / "digits").rglob("*.png"))
        assert sent_by(t) - before[t.name] < frames / 10, (t.name, sent_by(t) - before[t.name], frames)
    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["mode"] == "federated" and summary["rounds"] == 4
    # What travelled: the fp32 model down to each camera, its change up in int8 (a quarter, and a few headers).
    assert summary["bytes"]["model_down"] == sum(r["bytes_down"] for r in rounds(run_dir))
    assert 0 < summary["bytes"]["changes_up"] < summary["bytes"]["model_down"] / 3
    records = rounds(run_dir)
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert all(sorted(r["took_part"]) == ["node-1", "node-2", "node-3"] for r in records)
    assert records[-1]["val_accuracy"] > records[0]["val_accuracy"]
    assert summary["val_accuracy"] == records[-1]["val_accuracy"] > 0.5
    # Export's parity and accuracy gates need labelled images on the controller: the operator's own reference set.
    reference = tmp_path / "reference"
    write_digit_folders([reference], alpha=1000.0)
    for stage in ("consolidate", "export"):
        where = f"data.reference={json.dumps(str(reference))}"
        done = run_cli(stage, "--run-dir", str(run_dir), "--set", where, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    assert read_json(run_dir / layout.MODEL_JSON)["classes"] == [str(c) for c in range(10)]
    assert marked_processes(fleet) == []


@pytest.mark.slow  # about 2.5 minutes; test_oldest_torch.py runs the same with Python 3.10 devices in `make test`
def test_cameras_train_on_their_own_images_and_the_model_goes_on_through_the_chain(jetson_fleet, tmp_path) -> None:
    run_chain(jetson_fleet, tmp_path)


def wait_for_round(run_dir: Path, number: int, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / layout.METRICS).exists() and len(rounds(run_dir)) >= number:
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"round {number} not done in {timeout}s")


@pytest.mark.slow  # about 3 minutes: tests/train/cluster/test_flower.py covers busy devices in the quick suite
def test_a_busy_camera_waits_and_two_killed_ones_are_dropped_from_their_round_then_taken_back(
    jetson_fleet, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 4)
    write_digit_folders([t.disk / "digits" for t in fleet], alpha=0.5)
    # node-4 is busy (its inference service, say) while /opt/edge/busy exists on its disk.
    fleet["node-4"].run("touch /opt/edge/busy")
    inv = inventory(fleet, node_4={"idle_check": "test ! -e /opt/edge/busy"})
    run_dir = tmp_path / "run"
    args = ("--set", "train.federated.rounds=10", "--set", "train.federated.local_epochs=16")
    cmd = pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *FEDERATED, *args)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_round(run_dir, 1, proc)
        first = rounds(run_dir)[0]
        assert sorted(first["took_part"]) == ["node-1", "node-2", "node-3"]
        assert "idle check" in first["not_idle"]["node-4"]
        fleet["node-4"].run("rm /opt/edge/busy")
        time.sleep(1.0)  # well inside round 2's training
        for name in ("node-2", "node-3"):
            fleet[name].run("pkill -KILL -f 'pipeline[.]train[.]rank[.]federated'")
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    records = rounds(run_dir)
    assert [r["round"] for r in records] == list(range(1, 11))
    killed = [r for r in records[1:] if not {"node-2", "node-3"} & set(r["took_part"])]
    assert killed and killed[0]["failures"] == 2 and killed[0]["took_part"]  # the round went on without them
    assert {"node-2", "node-3", "node-4"} <= set(records[-1]["took_part"])  # all three taken back
    assert read_json(run_dir / layout.SUMMARY)["rounds"] == 10
    assert marked_processes(fleet) == []


@pytest.mark.slow  # about 3 minutes
def test_a_controller_killed_outright_resumes_from_the_last_aggregated_round(jetson_fleet, tmp_path: Path) -> None:
    """SIGKILL to `pipeline train` after round 2: every device's client stops with its SSH session; the same
    command again goes on from the last checkpointed round, and nothing before it is lost or done again."""
    fleet = start_cluster(jetson_fleet, 2)
    write_digit_folders([t.disk / "digits" for t in fleet], alpha=0.5)
    run_dir = tmp_path / "run"
    args = ("--set", "train.federated.rounds=6", "--set", "train.federated.local_epochs=8")
    cmd = pipeline_cmd("train", "--inventory", str(inventory(fleet)), "--run-dir", str(run_dir), *FEDERATED, *args)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_round(run_dir, 2, proc)
    finally:
        proc.kill()
        proc.communicate()
    saved = (run_dir / layout.LATEST).resolve()
    before = rounds(run_dir)
    deadline = time.monotonic() + 60
    while marked_processes(fleet):  # the devices' wrappers stop what the dead controller started
        assert time.monotonic() < deadline, marked_processes(fleet)
        time.sleep(1.0)
    again = run_cli(*cmd[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    numbers = [r["round"] for r in rounds(run_dir)]
    assert numbers[: len(before)] == [r["round"] for r in before]  # what the first run recorded stays
    last = int(saved.name.removeprefix("step-"))
    assert numbers[len(before) :] == list(range(last + 1, 7))  # the rest, each once
    assert read_json(run_dir / layout.SUMMARY)["rounds"] == 6
    assert marked_processes(fleet) == []
