"""Fleet inventory, probe parsing and rollout order: no devices needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest

from pipeline import deploy
from pipeline.config import Config, DeployConfig
from pipeline.deploy.remote import apply_activation, new_result
from pipeline.deploy.rollout import plan_rows, waves
from pipeline.errors import PipelineError
from pipeline.fleet.classes import DeviceClass
from pipeline.fleet.inventory import load_inventory
from pipeline.fleet.probe import parse_facts
from tests.harness.inventory import write_inventory

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, body: str, key: bool = True) -> Path:
    """An inventory at tmp_path/fleet.toml; `key` creates the key and known_hosts files it names."""
    (tmp_path / "home/.ssh").mkdir(parents=True, exist_ok=True)
    if key:
        (tmp_path / "home/.ssh/id_ed25519").write_text("key")
        (tmp_path / "home/.ssh/known_hosts").write_text("")
    path = tmp_path / "fleet.toml"
    path.write_text(body)
    return path


HEAD = """
[defaults]
user = "edge"
key = "~/.ssh/id_ed25519"
known_hosts = "~/.ssh/known_hosts"
service = "edge-infer"
[policy]
canary = 1
wave_size = 2
"""


def targets(*names: str, extra: str = "") -> str:
    return "".join(f'[[targets]]\nname = "{n}"\nhost = "10.0.0.{i}"\n{extra}\n' for i, n in enumerate(names, 1))


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_defaults_merge_into_targets_and_paths_expand(tmp_path: Path):
    path = write(
        tmp_path,
        HEAD + targets("orin-01", "orin-02") + '[[targets]]\nname = "nx"\nhost = "h"\nport = 2222\nservice = ""\n',
    )
    inventory = load_inventory(path)
    first, _, nx = inventory.targets
    assert first.user == "edge" and first.port == 22 and first.service == "edge-infer" and first.root == "/opt/edge"
    assert first.key == tmp_path / "home/.ssh/id_ed25519"
    assert first.known_hosts == tmp_path / "home/.ssh/known_hosts"
    assert nx.port == 2222 and nx.service == ""  # a target's own value wins over [defaults]
    assert inventory.policy.wave_size == 2 and inventory.policy.max_parallel == 8


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (HEAD + targets("a", extra="prot = 22"), r"fleet.toml: targets\[0\] \(a\): prot: unknown key"),
        (HEAD.replace('user = "edge"', 'usr = "edge"') + targets("a"), r"fleet.toml: defaults.usr: unknown key"),
        (HEAD + targets("a", "b", "a"), r"fleet.toml: targets: duplicate name 'a'"),
        (HEAD + '[[targets]]\nname = "x"\n', r"targets\[0\] \(x\): host: missing \(set it here or in \[defaults\]\)"),
        (HEAD + targets("a", extra="port = 0"), r"targets\[0\] \(a\): port: Input should be greater than"),
        (HEAD + targets("../a"), r"targets\[0\] \(../a\): name: .*not a safe name"),
        (HEAD + targets("a", extra='root = "opt/edge"'), r"targets\[0\] \(a\): root: .*must be an absolute path"),
        (HEAD + targets("a", extra='service = "--now"'), r"\(a\): service: .*'--now' is not a systemd unit"),
        (HEAD + targets("a", extra='service = "a b"'), r"targets\[0\] \(a\): service: .*'a b' is not a systemd unit"),
        (HEAD.replace("canary = 1", 'canary = ["zz"]') + targets("a"), r"policy: .*no target named 'zz'"),
        (HEAD + "[extra]\n" + targets("a"), r"unknown table \[extra\]"),
        (HEAD + targets("a", extra='idle = "1:30-5:30"'), r"targets\[0\] \(a\): idle: String should match pattern"),
        (HEAD + targets("a", extra='idle = "24:00-05:00"'), r"targets\[0\] \(a\): idle: String should match pattern"),
        (HEAD, r"needs at least one \[\[targets\]\]"),
    ],
)
def test_bad_inventories_name_the_target_and_key(tmp_path: Path, body: str, message: str):
    with pytest.raises(PipelineError, match=message):
        load_inventory(write(tmp_path, body))


def test_missing_key_file_and_known_hosts_are_errors(tmp_path: Path):
    path = write(tmp_path, HEAD + targets("orin-01"), key=False)
    with pytest.raises(PipelineError, match=r"orin-01: key: .*/home/.ssh/id_ed25519 not found"):
        load_inventory(path)
    (tmp_path / "home/.ssh/id_ed25519").write_text("key")
    with pytest.raises(PipelineError, match=r"orin-01: known_hosts: .* not found .*trust_on_first_use"):
        load_inventory(path)
    path.write_text(HEAD + targets("orin-01", extra="trust_on_first_use = true"))
    assert load_inventory(path).targets[0].trust_on_first_use


def test_cli_prints_one_line_and_exits_2_for_a_bad_inventory(tmp_path: Path):
    path = write(tmp_path, HEAD + targets("a", "a"))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "deploy", "plan", "--inventory", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "default"},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {path}: targets: duplicate name 'a'"]


def test_waves_put_the_canary_first_then_wave_size(tmp_path: Path):
    names = [f"t{i}" for i in range(7)]
    inventory = load_inventory(write(tmp_path, HEAD + targets(*names)))
    assert [[t.name for t in w] for w in waves(inventory)] == [["t0"], ["t1", "t2"], ["t3", "t4"], ["t5", "t6"]]
    named = load_inventory(write(tmp_path, HEAD.replace("canary = 1", 'canary = ["t3", "t5"]') + targets(*names)))
    assert [[t.name for t in w] for w in waves(named)] == [["t3", "t5"], ["t0", "t1"], ["t2", "t4"], ["t6"]]
    assert [r["wave"] for r in plan_rows(named)][:3] == ["canary", "canary", "wave 1"]
    none = load_inventory(write(tmp_path, HEAD.replace("canary = 1", "canary = 0") + targets(*names[:3])))
    assert [[t.name for t in w] for w in waves(none)] == [["t0", "t1"], ["t2"]]
    assert [r["wave"] for r in plan_rows(none)] == ["wave 1", "wave 1", "wave 2"]


PROBE = """model=NVIDIA Jetson AGX Orin Developer Kit
compatible=nvidia,p3737-0000+p3701-0005 nvidia,p3701-0005 nvidia,tegra234
l4t=# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64
pkg=nvidia-jetpack 6.2+b77
pkg=tensorrt 10.3.0.30-1+cuda12.5
free_kb=51200
thermal=cpu-thermal 45000
thermal=gpu-thermal 71500
hostname=orin-01
current=releases/run-b-12345678
previous=releases/run-a-12345678
"""


def test_probe_output_becomes_facts_and_a_device_class():
    facts = parse_facts(PROBE)
    assert (facts.model, facts.soc, facts.l4t) == ("NVIDIA Jetson AGX Orin Developer Kit", "nvidia,tegra234", "36.4.3")
    assert (facts.jetpack, facts.tensorrt, facts.free_bytes) == ("6.2", "10.3.0", 51200 * 1024)
    assert facts.temperatures == {"cpu-thermal": 45.0, "gpu-thermal": 71.5} and facts.max_temp_c == 71.5
    assert (facts.current, facts.previous) == ("run-b-12345678", "run-a-12345678")
    assert str(DeviceClass.probed(facts)) == "orin-sm87-trt10.3.0"
    xavier = parse_facts("model=NVIDIA Jetson Xavier NX Developer Kit\npkg=tensorrt 8.5.2.2-1+cuda11.4\n")
    assert str(DeviceClass.probed(xavier)) == "xavier-sm72-trt8.5.2"  # no compatible: the SoC comes from the model name
    assert str(DeviceClass.probed(parse_facts("model=\nfree_kb=\n"))) == "unknown-sm?-trt?"


def test_activation_report_is_parsed_and_checked(tmp_path: Path):
    path = write(tmp_path, HEAD + targets("a"))
    row = new_result(load_inventory(path).targets[0], "r2")
    apply_activation(
        "x\nACTIVATE status=ROLLED_BACK\nACTIVATE current=r1\nACTIVATE reason=after switch: boom\n", "", row
    )
    assert (row.status, row.current, row.reason, row.health) == ("ROLLED_BACK", "r1", "after switch: boom", {})
    apply_activation("garbage\n", "sh: activate.sh: not found", row)
    assert row.status == "FAILED" and row.reason == "activate.sh: sh: activate.sh: not found"
    apply_activation("ACTIVATE status=ACTIVE\nACTIVATE current=r1\n", "", row)
    assert row.status == "FAILED" and "current is 'r1'" in row.reason
    apply_activation('ACTIVATE status=ACTIVE\nACTIVATE current=r2\nACTIVATE health={"passed": true}\n', "", row)
    assert (row.status, row.health) == ("ACTIVE", {"passed": True})


@pytest.mark.parametrize("kind", ["garbage", "encrypted"])
def test_an_unusable_private_key_refuses_the_target_and_results_are_written(
    tmp_path: Path, kind: str, make_run, onnx_models
):
    """A garbage or passphrase-protected key: the target is REFUSED with the reason (no traceback, no connection
    attempted), the rollout still writes deploy/results.json, and the stage fails with one line."""
    key = tmp_path / "id_ed25519"
    if kind == "garbage":
        key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----\n")
    else:
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(key), "pkcs8-pem", passphrase="secret")
    (tmp_path / "known_hosts").write_text("")
    inventory = write_inventory(
        tmp_path / "fleet.toml",
        {"key": str(key), "known_hosts": str(tmp_path / "known_hosts"), "root": str(tmp_path / "edge")},
        {"canary": 0},
        [{"name": "orin-01", "host": "127.0.0.1", "port": 9}],
    )
    run = make_run("20260101-000000-keys", onnx_models[0])
    cfg = Config(deploy=DeployConfig(inventory=inventory))
    with pytest.raises(PipelineError, match=r"orin-01 \(REFUSED: key .*id_ed25519: not a usable private key"):
        deploy.run(cfg, run, log=lambda _: None)
    (row,) = json.loads((run.path / "deploy/results.json").read_text())["targets"]
    assert row["status"] == "REFUSED" and "not a usable private key" in row["reason"]
