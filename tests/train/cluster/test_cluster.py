"""Cluster training over SSH against stand-in Jetsons (tests/harness): real sshd per device, each in its own network
namespace with a private disk, reached over a veth link; no device can see another's files or the controller's.

Honest limits of the stand-ins: they are not ARM boards and run the controller's own interpreter (this venv's
Python, whose prefix under /root is mapped in read-only with `TargetSpec.host_dirs`), so "the device's Python and
torch" are this machine's; the code they train with is the shipped zip on their private disk (the test checks the
ranks import it from there). The devices reach each other through the host, which forwards between the links.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.files import read_json
from pipeline.fleet import devicecheck
from tests.harness import JetsonFleet, TargetSpec, fixtures, network

jetson_fleet = fixtures.jetson_fleet
VENV_PYTHON = str(Path(sys.executable).absolute())
PYTHON_PREFIX = sys.base_prefix
REPO = Path(__file__).resolve().parents[3]
OLD_PYTHON = "/root/.pyenv/versions/3.8.18"


@pytest.fixture
def forwarding() -> Iterator[None]:
    """The host forwards between device links for the test's duration (the devices talk to each other)."""
    with network.ip_forwarding():
        yield


def start_cluster(jetson_fleet: Callable[..., JetsonFleet], count: int, **extra_dirs: str) -> JetsonFleet:
    """`count` linked stand-ins that run this venv's Python, each routed to the others through the host."""
    # The checkout (this venv lives in it) may be where a device's fresh /tmp or /root would hide it: map it in.
    dirs = (PYTHON_PREFIX, str(REPO), *extra_dirs.values())
    specs = [TargetSpec(f"node-{i}", network=True, disk_size="256m", host_dirs=dirs) for i in range(1, count + 1)]
    fleet = jetson_fleet(specs)
    for target in fleet:
        assert target.link is not None
        target.link.in_device(f"ip route add 10.213.0.0/16 via {target.link.host_ip}")
    return fleet


def inventory(fleet: JetsonFleet, path: Path | None = None, **per_target: dict[str, str]) -> Path:
    """The fleet's inventory with the training keys: this venv's Python, the link's interface."""
    extra = {
        t.name: {"python": VENV_PYTHON, "ifname": "eth0", **per_target.get(t.name.replace("-", "_"), {})} for t in fleet
    }
    return fleet.write_inventory(path, extra=extra)


def pipeline_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pipeline_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def marked_processes(fleet: JetsonFleet) -> list[str]:
    """Training processes (torchrun agents, ranks, federated clients) running in any stand-in."""
    found = []
    for target in fleet:
        if target.running:
            pattern = "torch.distributed.run|pipeline.train.rank.(worker|federated)"
            out = target.run(f"ps -eo pid,args | grep -E '{pattern}' | grep -v grep; true")
            found += [f"{target.name}: {line}" for line in out.stdout.splitlines() if line.strip()]
    return found


def test_check_reports_each_device_and_ships_the_code_once(jetson_fleet, forwarding, tmp_path: Path) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    first = run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    rows = json.loads(first.stdout)
    assert [r["status"] for r in rows] == ["ready", "ready"]
    assert rows[0]["python"] == ".".join(map(str, sys.version_info[:3])) and rows[0]["torch"]
    assert rows[0]["code"] and rows[0]["bytes_sent"] > 0 and rows[0]["missing"] == ""
    again = json.loads(run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path).stdout)
    assert [r["bytes_sent"] for r in again] == [0, 0]  # unchanged code: nothing sent
    assert {r["code"] for r in again} == {rows[0]["code"]}
    shipped = fleet["node-1"].disk / "train/code" / rows[0]["code"] / "code.zip"
    assert shipped.is_file()


@pytest.mark.slow  # ~30 s: three stand-ins, each set up to fail differently
def test_unfit_devices_are_refused_in_one_line(jetson_fleet, forwarding, tmp_path: Path) -> None:
    """Python 3.8, a Python without torch and the rest, code that is not the controller's: one line each, exit 2."""
    fleet = start_cluster(jetson_fleet, 3, old=OLD_PYTHON)
    # A copy of this code with one file changed, as an old checkout on the device would be.
    source = Path(devicecheck.__file__).parents[2]
    fleet["node-3"].run(f"mkdir /opt/edge/other && cp -r {source}/pipeline {source}/models /opt/edge/other/")
    fleet["node-3"].run("echo '__version__ = \"0.0.0\"' > /opt/edge/other/pipeline/__init__.py")
    cases = {
        "node_1": {"python": f"{OLD_PYTHON}/bin/python3.8"},
        "node_2": {"python": "/usr/bin/python3"},
        "node_3": {"code": "/opt/edge/other"},
    }
    expected = {
        "node_1": r"node-1: refused: Python 3\.8\.\d+ \(.*python3\.8\) is older than 3\.10",
        "node_2": r"node-2: refused: missing Python packages torch>=2\.5, .*pydantic.*: install with "
        r"`/usr/bin/python3 -m pip",
        "node_3": r"node-3: refused: runs code \w+ \(/opt/edge/other\), not the controller's \w+",
    }
    for name, keys in cases.items():
        only = inventory(fleet, tmp_path / f"{name}.toml", **{name: keys})
        text = only.read_text()
        out = run_cli("train", "--inventory", str(only), "--run-dir", str(tmp_path / name), cwd=tmp_path)
        assert out.returncode == 2, out.stdout + out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert re.match(f"error: {expected[name]}", lines[0]), lines[0]
        assert not (tmp_path / name / layout.TRAIN_DIR).exists() and text
    assert marked_processes(fleet) == []


def test_bad_inventory_and_unreachable_device_are_one_line(jetson_fleet, forwarding, tmp_path: Path) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    bad = tmp_path / "bad.toml"
    bad.write_text(inv.read_text().replace('ifname = "eth0"', 'ifname = "eth0; rm -rf /"', 1))
    out = run_cli("train", "--inventory", str(bad), "--run-dir", str(tmp_path / "r1"), cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "ifname" in out.stderr
    fleet["node-2"].kill()
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(tmp_path / "r2"), cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: node-2: unreachable: "), out.stderr
    assert marked_processes(fleet) == []


@pytest.mark.slow
def test_three_devices_train_the_quickstart_and_the_run_goes_on_unchanged(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 3)
    inv = inventory(fleet)
    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), "--set", "train.epochs=4", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["world_size"] == 3 and summary["nodes"] == ["node-1", "node-2", "node-3"]
    assert summary["val_accuracy"] >= 0.9
    assert "[node-1] " in out.stderr + out.stdout
    latest = run_dir / layout.LATEST
    assert sorted(p.name for p in latest.glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt", "rng-2.pt"]
    # Each device holds only its own shards; none sees another's disk or the controller's run directory.
    for target in fleet:
        assert target.run(f"test -e {run_dir}", check=False).returncode != 0
        assert target.run("ls /opt/edge/train/runs").stdout.split() == [f"run-{_key(run_dir)}"]
    for stage in ("consolidate", "export"):
        done = run_cli(stage, "--run-dir", str(run_dir), cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    assert (run_dir / layout.ONNX).is_file()
    assert marked_processes(fleet) == []


def _key(run_dir: Path) -> str:
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]


@pytest.mark.slow
def test_ctrl_c_on_the_controller_leaves_nothing_running_on_any_device(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 3)
    inv = inventory(fleet)
    proc = subprocess.Popen(
        pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(tmp_path / "run"), "--set", "train.epochs=50"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C as a terminal delivers it: a test run started with `&` would hand SIGINT down ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while len(marked_processes(fleet)) < 6 and time.monotonic() < deadline:  # an agent and a rank per device
        time.sleep(1)
    assert len(marked_processes(fleet)) >= 6
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert marked_processes(fleet) == []


ELASTIC = ("--set", "train.epochs=4", "--set", "train.devices=2:3", "--set", "train.checkpoint_every_steps=10")


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["node-2", "node-1"])
def test_a_device_lost_mid_run_leaves_the_others_training(
    jetson_fleet, forwarding, tmp_path: Path, victim: str
) -> None:
    """The whole stand-in dies (power loss) once the controller holds a checkpoint; the other two finish the run
    within one point of an uninterrupted one, and summary.json says who left and what it cost."""
    fleet = start_cluster(jetson_fleet, 3)
    inv = inventory(fleet)
    straight = run_cli(
        "train", "--inventory", str(inv), "--run-dir", str(tmp_path / "straight"), *ELASTIC, cwd=tmp_path
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), *ELASTIC),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not (run_dir / layout.LATEST).is_symlink() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    killed_at = time.time()
    fleet[victim].kill()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-4000:]
    summary = read_json(run_dir / layout.SUMMARY)
    reference = read_json(tmp_path / "straight" / layout.SUMMARY)
    assert abs(summary["val_accuracy"] - reference["val_accuracy"]) <= 0.01, (summary, reference)
    assert summary["world_size"] == 2 and victim not in summary["nodes"] and summary["rounds"] == 2
    (left,) = summary["events"]
    assert left["event"] == "left" and left["node"] == victim and left["time"] >= killed_at
    assert left["steps_lost"] == left["at_step"] - left["resumed_step"] >= 0
    assert json.loads((run_dir / layout.METRICS).read_text().splitlines()[-1])["event"] == "left"
    assert marked_processes(fleet) == []
