"""Attacks on the SSH training job, replayed on stand-ins (docs/security.md): another machine on the devices' WiFi
(a third stand-in's network namespace, not in the job) goes for the rendezvous store, the run directory's name and
`train.env` carry shell syntax, and a token passed with `train.pass_env` is looked for wherever it could leak.

What held before these tests: nothing. The controller's store listened on every interface, and torch's rendezvous
unpickles what it reads there: the attacker's pickle ran as root on both devices.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.config import toml_value
from pipeline.files import read_json
from tests.harness import JetsonFleet, fixtures
from tests.harness.jetsons import JetsonTarget
from tests.train.cluster.test_cluster import VENV_PYTHON, forwarding, marked_processes, pipeline_cmd
from tests.train.cluster.test_cluster import start_cluster as start_linked
from tests.train.listening import listeners, listening_here, tree_pids

jetson_fleet = fixtures.jetson_fleet
__all__ = ["forwarding"]  # a fixture this module uses by name

PWNED = "/opt/edge/pwned"
TOKEN = "tok-5ecret-" + "x" * 24
HOSTILE_VALUE = "a'b\"$(touch /opt/edge/pwned-env)`id`"


def training_listeners(target: JetsonTarget) -> list[tuple[str, int]]:
    """The listening sockets of the training processes (agent, ranks) on a device."""
    ranks = target.run("pgrep -f 'torch.distributed.run|pipeline.train.rank.worker'", check=False).stdout
    return listeners(target.run("ss -ltnpH").stdout, {int(p) for p in ranks.split()})


class _Exploit:
    """What the attacker writes into the rendezvous store: unpickled, it runs a shell command."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {PWNED}",)


ATTACK = """
import base64, sys, datetime
from torch.distributed import TCPStore
host, payload = sys.argv[1], base64.b64decode(sys.argv[2])
for port in map(int, sys.argv[3:]):
    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3), use_libuv=True)
        keys = [k for k in getattr(store, "list_keys", list)() if k.startswith("torch.rendezvous.")]
        for key in keys or ["torch.rendezvous.guess"]:
            store.set(key, base64.b64encode(payload))
        print("REACHED", port, keys)
    except Exception as err:
        print("REFUSED", port, type(err).__name__)
"""


def attack_from(attacker: JetsonTarget, host_ip: str, ports: list[int], python: str) -> str:
    """Run the store attack from the attacker's network namespace against `host_ip` on each of `ports`."""
    payload = base64.b64encode(pickle.dumps(_Exploit())).decode()
    argv = " ".join([python, "-c", _quote(ATTACK), host_ip, payload, *map(str, ports)])
    return attacker.run(argv, check=False).stdout


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def run_attacked_job(jetson_fleet: Callable[..., JetsonFleet], tmp_path: Path, device_python: str) -> None:
    """Two devices train; a third, on the same network, attacks while they do; every leak is looked for."""
    extra = {"oldest": str(Path(device_python).resolve().parents[1])} if device_python != VENV_PYTHON else {}
    fleet = start_linked(jetson_fleet, 3, **extra)
    job, attacker = [fleet["node-1"], fleet["node-2"]], fleet["node-3"]
    training = {"python": device_python, "ifname": "eth0"}
    inv = fleet.write_inventory(names=["node-1", "node-2"], extra={"node-1": training, "node-2": training})
    run_dir = tmp_path / "run $(touch PWNED_DIR);x"
    cmd = pipeline_cmd("train", "--inventory", str(inv), "--run-dir", str(run_dir), "--set", "train.epochs=3",
                       "--set", f"train.env={{HOSTILE = {toml_value(HOSTILE_VALUE)}}}",
                       "--set", 'train.pass_env=["PIPELINE_TEST_TOKEN"]')  # fmt: skip
    env = {**os.environ, "PIPELINE_TEST_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 300
    while len(marked_processes(fleet)) < 4 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert len(marked_processes(fleet)) >= 4, "the job did not start"
    while not all(training_listeners(t) for t in job) and time.monotonic() < deadline:
        time.sleep(0.5)  # the ranks listen once their process group is up

    # The controller: every socket it listens on is on loopback (the store; the devices reach it over SSH).
    controller = listening_here(tree_pids(proc.pid))
    assert controller and all(addr.startswith("127.0.0.1:") for addr, _ in controller), controller
    # The devices: the training processes listen on the device's own link address or loopback, never on all.
    for target in job:
        assert target.link is not None
        found = training_listeners(target)
        assert found, f"{target.name}: no listener of the training processes"
        allowed = (f"{target.link.device_ip}:", "127.0.0.1:")
        assert all(addr.startswith(allowed) for addr, _ in found), (target.name, found)
        # The token is in the ranks' environment (it arrived) and on no command line.
        cmdlines = target.run("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; true").stdout
        assert TOKEN not in cmdlines and "HOSTILE" not in cmdlines
        rank = "pgrep -f '^[^ ]*python[^ ]* .*pipeline.train.rank.worker' | tail -1"  # not the wrapper's sh
        environ = target.run(f"cat /proc/$({rank})/environ | tr '\\0' '\\n'")
        assert f"PIPELINE_TEST_TOKEN={TOKEN}" in environ.stdout.splitlines()
        assert f"HOSTILE={HOSTILE_VALUE}" in environ.stdout.splitlines()  # verbatim, not run

    # The attack: every port the controller listens on, from the attacker's side of the network.
    assert attacker.link is not None
    ports = sorted({int(addr.rsplit(":", 1)[1]) for addr, _ in controller})
    report = attack_from(attacker, attacker.link.host_ip, ports, device_python)
    assert "REACHED" not in report and report.count("REFUSED") == len(ports), report

    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert read_json(run_dir / layout.SUMMARY)["world_size"] == 2
    for target in job:
        assert target.run(f"ls {PWNED} /opt/edge/pwned-env; true").stdout.strip() == "", target.name
        assert target.run("find / -xdev -name 'PWNED_DIR*' 2>/dev/null; true").stdout.strip() == ""
        kept = target.run(f"grep -rl {TOKEN} /opt/edge 2>/dev/null; true").stdout.strip()
        assert kept == "", f"{target.name} keeps the token in {kept}"
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert leaked == [] and TOKEN not in out + err, leaked
    assert marked_processes(fleet) == []


@pytest.mark.slow  # `make test` runs the same attacks on Python 3.10 / torch 2.5 devices (test_oldest_torch.py)
def test_an_attacker_on_the_network_reaches_no_store_and_nothing_leaks(jetson_fleet, forwarding, tmp_path) -> None:
    run_attacked_job(jetson_fleet, tmp_path, VENV_PYTHON)
