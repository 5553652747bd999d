"""SSH fleet deploys against stand-in Jetsons (real sshd per device; stand-in trtexec/systemctl/dpkg-query).

Every fault test starts from a device running a good release and asserts it ends on that release, files intact.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline import deploy
from pipeline.cli import app
from pipeline.config import BuildConfig, Config, DeployConfig, LocalTarget
from pipeline.deploy import remote, ssh_fleet
from pipeline.deploy.result import TargetResult
from pipeline.errors import PipelineError, TransientError
from pipeline.fleet.inventory import load_inventory
from pipeline.fleet.ssh import Device
from pipeline.manifest import RunDir, StageResult
from tests import durability
from tests.harness import AGX_ORIN_JP62, XAVIER_NX_JP513, JetsonFleet, JetsonTarget, TargetSpec, fixtures, make_plan
from tests.harness.procs import tool

pytest.importorskip("asyncssh")

QUIET = {"log": lambda _: None}
ORIN = "orin-sm87-trt10.3.0"
jetson_fleet = fixtures.jetson_fleet
MakeRun = Callable[..., RunDir]


NX = "xavier-sm72-trt8.5.2"
STANDIN = {ORIN: ("10.3.0.30", "nvidia,tegra234"), NX: ("8.5.2.2", "nvidia,tegra194")}


def record_engine(run: RunDir, size: int = 4096, classes: tuple[str, ...] = (ORIN,)) -> None:
    """Stand-in engines (which the stand-in trtexec loads on their class) recorded as the build stage's outputs:
    one class as the single `engine` output, several as `engine:<class>` outputs."""
    outputs = {}
    for klass in classes:
        out = run.path / "engines" / klass
        out.mkdir(parents=True)
        version, soc = STANDIN[klass]
        (out / "model.plan").write_bytes(make_plan(version, {"soc": soc, "run": run.path.name}, size))
        (out / "build.json").write_text(json.dumps({"class": klass, "precision": "fp16"}))
        key = "" if len(classes) == 1 else f":{klass}"
        outputs |= {f"engine{key}": f"engines/{klass}/model.plan", f"build_info{key}": f"engines/{klass}/build.json"}
    run.record(StageResult("build", "done", outputs=outputs), {})


def fleet_cfg(fleet: JetsonFleet, **inventory: Any) -> Config:
    """The fleet's inventory; install-time builds keep their engines in the fleet's own engine cache."""
    build = BuildConfig(cache_dir=fleet.dir / "engine-cache", timeout_s=60)
    return Config(build=build, deploy=DeployConfig(inventory=fleet.write_inventory(**inventory)))


def results(run: RunDir) -> dict[str, dict[str, Any]]:
    return {r["target"]: r for r in json.loads((run.path / "deploy/results.json").read_text())["targets"]}


def links(target: JetsonTarget) -> tuple[str, str]:
    out = target.run("cd /opt/edge && echo $(readlink current) $(readlink previous) .", check=False).stdout.split()
    return tuple(p.removeprefix("releases/") for p in out[:-1]) + ("",) * (3 - len(out))  # type: ignore[return-value]


def intact(target: JetsonTarget, release: str) -> bool:
    """`current` points at `release` and every file matches its SHA256SUMS, checked on the device."""
    check = target.run("cd /opt/edge/current && sha256sum -c SHA256SUMS && readlink /opt/edge/current", check=False)
    return check.returncode == 0 and check.stdout.strip().endswith(f"releases/{release}")


@pytest.fixture
def make_two_runs(make_run: MakeRun, onnx_models: list[Path]) -> Callable[..., tuple[RunDir, RunDir]]:
    """make_two_runs(size=4096): a good first release and a second one (other model), both with an Orin engine;
    the second's engine has `size` bytes (big ones let a test interrupt its upload)."""

    def make(size: int = 4096) -> tuple[RunDir, RunDir]:
        first, second = make_run("run-a", onnx_models[0]), make_run("run-b", onnx_models[1])
        record_engine(first)
        record_engine(second, size=size)
        return first, second

    return make


@pytest.fixture
def two_runs(make_two_runs: Callable[..., tuple[RunDir, RunDir]]) -> tuple[RunDir, RunDir]:
    """Two releases with small engines."""
    return make_two_runs()


def deploy_ok(cfg: Config, run: RunDir) -> str:
    return deploy.run(cfg, run, **QUIET).metrics["release"]


def test_rollout_probe_redeploy_and_second_release(jetson_fleet, two_runs: tuple[RunDir, RunDir]):
    fleet = jetson_fleet(3)
    cfg = fleet_cfg(fleet, defaults={"service": "edge-infer"}, policy={"wave_size": 2})
    for target in fleet:
        target.standins.set_unit("edge-infer")
    first, second = two_runs

    a = deploy_ok(cfg, first)
    rows = results(first)
    assert {r["status"] for r in rows.values()} == {"ACTIVE"}
    assert all(r["device_class"] == ORIN and r["previous"] == "" for r in rows.values())
    sent = rows["orin-01"]["bytes_sent"]
    files = sorted(p.name for p in (first.path / "deploy").iterdir())
    installed = [p for p in (fleet["orin-01"].disk / "releases" / a).iterdir() if not p.name.startswith(".")]
    assert sent == sum(p.stat().st_size for p in installed) and len(installed) == 8  # .order: activation order
    assert "activate.sh" in os.listdir(fleet["orin-01"].disk / "releases" / a) and "plan.json" in files
    plan = json.loads((first.path / "deploy/plan.json").read_text())
    assert plan["waves"] == [["orin-01"], ["orin-02", "orin-03"]] and "activate.sh" in plan["variants"][ORIN]["files"]
    for target in fleet:
        assert intact(target, a)
        trtexec = target.standins.calls("trtexec")
        assert trtexec[-1][1:] == [f"--loadEngine=/opt/edge/releases/{a}/model.plan"]
        assert target.standins.calls("systemctl")[-2:] == [
            ["/usr/local/bin/systemctl", "restart", "edge-infer"],
            ["/usr/local/bin/systemctl", "is-active", "edge-infer"],
        ]

    deploy_ok(cfg, first)  # unchanged: nothing sent, nothing restarted
    assert {(r["status"], r["bytes_sent"], r["reason"]) for r in results(first).values()} == {
        ("ACTIVE", 0, "already active")
    }

    b = deploy_ok(cfg, second)
    row = results(second)["orin-02"]
    assert (row["previous"], row["current"], row["status"]) == (a, b, "ACTIVE")
    assert row["files_reused"] >= 2  # labels.txt and model.json are the same: linked on the device, not sent
    assert 0 < row["bytes_sent"] < sent + (fleet["orin-02"].disk / "releases" / b / "model.onnx").stat().st_size
    assert links(fleet["orin-02"]) == (b, a)

    status = {r["target"]: r for r in ssh_fleet.status(load_inventory(cfg.deploy.inventory))}
    assert status["orin-03"] | {"seconds": 0} == {
        "target": "orin-03",
        "status": "reachable",
        "model": "NVIDIA Jetson AGX Orin Developer Kit",
        "l4t": "36.4.3",
        "jetpack": "6.2",
        "tensorrt": "10.3.0",
        "class": ORIN,
        "free": status["orin-03"]["free"],
        "temp": "45.0 C",
        "current": b,
        "previous": a,
        "seconds": 0,
    }

    rolled = ssh_fleet.rollback(load_inventory(cfg.deploy.inventory), "orin-03")
    assert rolled == [{"target": "orin-03", "status": "ROLLED_BACK", "current": a, "previous": b, "reason": ""}]
    assert intact(fleet["orin-03"], a) and links(fleet["orin-02"]) == (b, a)


def test_without_tensorrt_or_space_a_device_is_refused_the_others_get_their_class_engine(
    jetson_fleet, two_runs, make_run, onnx_models
):
    bare = replace(AGX_ORIN_JP62, packages={"nvidia-jetpack": "6.2+b77"})  # no TensorRT package
    specs = [TargetSpec("orin-01"), TargetSpec("nx-01", board=XAVIER_NX_JP513), TargetSpec("bare", board=bare)]
    fleet = jetson_fleet([*specs, TargetSpec("tiny")])
    cfg = fleet_cfg(fleet, policy={"canary": 0, "max_failure_pct": 100})
    plain = make_run("run-plain", onnx_models[0])
    deploy_ok(cfg, plain)  # no engines in the run: each class is built on its first device; `bare` gets ONNX only
    rows = results(plain)
    assert sorted(r["built_on_device"] for r in rows.values()) == [False, False, True, True]  # orin-01, tiny: 1 class
    assert rows["bare"]["device_class"] == "orin-sm87-trt?" and not (fleet["bare"].disk / "current/model.plan").exists()
    fleet["tiny"].resize_disk("300k")  # the release (~250 kB, no 2x headroom left)
    with pytest.raises(PipelineError, match="2 of 4 targets not active") as err:
        deploy.run(cfg, two_runs[0], **QUIET)
    assert not isinstance(err.value, TransientError)  # a refusal will not change on a retry
    rows = results(two_runs[0])
    assert rows["orin-01"]["status"] == "ACTIVE" and not rows["orin-01"]["built_on_device"]  # the run's engine
    # No engine for its class in this run: the one its device built for the plain run (same ONNX), from the cache.
    nx_builds = [c for c in fleet["nx-01"].standins.calls("trtexec") if any(a.startswith("--onnx=") for a in c)]
    assert rows["nx-01"]["status"] == "ACTIVE" and not rows["nx-01"]["built_on_device"] and len(nx_builds) == 1
    assert rows["bare"]["status"] == "REFUSED" and rows["bare"]["bytes_sent"] == 0
    assert rows["bare"]["reason"].startswith(f"engine built for {ORIN}") and rows["bare"]["reason"].endswith(
        "device is orin-sm87-trt? (NVIDIA Jetson AGX Orin Developer Kit, no TensorRT package): it can neither build "
        "nor load one"
    )
    assert rows["tiny"]["status"] == "REFUSED" and "< 2x the release" in rows["tiny"]["reason"]
    assert rows["tiny"]["bytes_sent"] == 0
    for name in ("bare", "tiny"):
        a = results(plain)[name]["release"]
        assert intact(fleet[name], a) and links(fleet[name]) == (a, "")
        assert sorted(os.listdir(fleet[name].disk / "releases")) == [a]

    # Engines for both classes: each device gets the one built for it (and the stand-in trtexec loads it).
    both = make_run("run-both", onnx_models[1])
    record_engine(both, classes=(ORIN, NX))
    cfg = fleet_cfg(fleet, names=["orin-01", "nx-01"], policy={"canary": 0})
    deploy_ok(cfg, both)
    for name, klass in (("orin-01", ORIN), ("nx-01", NX)):
        c = results(both)[name]["release"]  # each variant has its own id: its engine differs
        engine = (fleet[name].disk / "releases" / c / "model.plan").read_bytes()
        assert engine == (both.path / "engines" / klass / "model.plan").read_bytes() and intact(fleet[name], c)
    assert sorted(json.loads((both.path / "deploy/plan.json").read_text())["variants"]) == [ORIN, NX]


def test_failing_preflight_keeps_the_previous_release(jetson_fleet, two_runs):
    fleet = jetson_fleet(1)
    cfg = fleet_cfg(fleet)
    a = deploy_ok(cfg, two_runs[0])
    fleet["orin-01"].standins.set_trtexec(load_exit=1, error="Error[1]: engine deserialization failed")
    with pytest.raises(PipelineError, match=r"orin-01 \(PREFLIGHT_FAILED: preflight: .*deserialization failed"):
        deploy.run(cfg, two_runs[1], **QUIET)
    assert intact(fleet["orin-01"], a) and links(fleet["orin-01"]) == (a, "")
    assert os.listdir(fleet["orin-01"].disk / "releases") == [a]  # the failed release was removed


def files_on(target: JetsonTarget) -> str:
    """sha256 and name of every file under the device's releases/ and the links, as the device sees them."""
    listing = "cd /opt/edge && find releases -type f | sort | xargs sha256sum && ls -l current previous 2>&1"
    return target.run(listing, check=False).stdout


def test_a_rebuilt_engine_is_a_new_release_and_never_touches_the_live_one(jetson_fleet, make_run, onnx_models):
    """Same ONNX, engine rebuilt (TensorRT builds are not byte-identical): a new id, so a failing preflight leaves
    every device on its release, byte for byte."""
    fleet = jetson_fleet(2)
    cfg = fleet_cfg(fleet, policy={"canary": 0})
    run = make_run("run-r", onnx_models[0])
    record_engine(run)
    a = deploy_ok(cfg, run)
    before = {t.name: files_on(t) for t in fleet}
    engine = run.path / f"engines/{ORIN}/model.plan"
    engine.write_bytes(make_plan("10.3.0.30", {"soc": "nvidia,tegra234", "rebuilt": True}, 4096))
    for target in fleet:
        target.standins.set_trtexec(load_exit=1, error="Error[1]: engine deserialization failed")
    with pytest.raises(PipelineError, match=r"2 of 2 targets not active: .*PREFLIGHT_FAILED"):
        deploy.run(cfg, run, **QUIET)
    rows = results(run)
    assert {r["release"] for r in rows.values()} != {a} and all(r["current"] == a for r in rows.values())
    for target in fleet:
        assert files_on(target) == before[target.name] and intact(target, a) and links(target) == (a, "")


def test_service_failing_after_the_switch_rolls_back(jetson_fleet, two_runs):
    fleet = jetson_fleet(1)
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet, defaults={"service": "edge-infer"})
    target.standins.set_unit("edge-infer")
    a = deploy_ok(cfg, two_runs[0])
    target.standins.set_unit("edge-infer", healthy=False)
    target.standins.clear_calls()
    with pytest.raises(PipelineError, match=r"ROLLED_BACK: after switch: edge-infer is failed after restart"):
        deploy.run(cfg, two_runs[1], **QUIET)
    assert results(two_runs[1])["orin-01"]["current"] == a
    assert intact(target, a) and links(target) == (a, "")
    restarts = [c for c in target.standins.calls("systemctl") if c[1] == "restart"]
    assert len(restarts) == 2  # onto the new release, then back onto the old one


def test_checksum_mismatch_on_the_device_then_resume(jetson_fleet, two_runs, monkeypatch):
    fleet = jetson_fleet(1)
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet)
    a = deploy_ok(cfg, two_runs[0])
    put = Device.put

    async def corrupting_put(self: Device, local: Path, remote_path: str) -> int:
        sent = await put(self, local, remote_path)
        if remote_path.endswith("/model.onnx"):  # bit rot between the upload and the check
            target.run(f"printf X | dd of={remote_path} bs=1 seek=100 conv=notrunc 2>/dev/null")
        return sent

    monkeypatch.setattr(Device, "put", corrupting_put)
    with pytest.raises(PipelineError, match=r"VERIFY_FAILED: checksum mismatch on the device: model.onnx"):
        deploy.run(cfg, two_runs[1], **QUIET)
    assert intact(target, a) and links(target) == (a, "")
    monkeypatch.setattr(Device, "put", put)

    b = deploy_ok(cfg, two_runs[1])  # resumes: only the file that failed is sent again
    row = results(two_runs[1])["orin-01"]
    assert row["files_sent"] == 1 and row["bytes_sent"] == (target.disk / "releases" / b / "model.onnx").stat().st_size
    assert intact(target, b) and links(target) == (b, a)


def test_unreachable_and_unknown_hosts_others_go_on(jetson_fleet, two_runs, tmp_path):
    fleet = jetson_fleet([TargetSpec("orin-01"), TargetSpec("orin-02"), TargetSpec("stranger", in_known_hosts=False)])
    cfg = fleet_cfg(fleet, policy={"canary": 1, "max_failure_pct": 70})
    fleet["orin-02"].kill()
    with pytest.raises(PipelineError, match="2 of 3 targets not active") as err:
        deploy.run(cfg, two_runs[0], **QUIET)
    assert not isinstance(err.value, TransientError)  # a refused host key will not change on a retry
    rows = results(two_runs[0])
    assert rows["orin-01"]["status"] == "ACTIVE"
    assert rows["orin-02"]["status"] == "UNREACHABLE" and "connect: ConnectionRefusedError" in rows["orin-02"]["reason"]
    assert rows["stranger"]["status"] == "REFUSED" and "is not in known_hosts" in rows["stranger"]["reason"]
    assert not os.listdir(fleet["stranger"].disk)  # nothing was written to a device we could not verify

    # Trust on first use, asked for explicitly: the key is recorded, and a changed key is refused afterwards.
    tofu = fleet.write_inventory(tmp_path / "tofu.toml", names=["stranger"], defaults={"trust_on_first_use": True})
    assert deploy_ok(Config(deploy=DeployConfig(inventory=tofu)), two_runs[0])
    where = f"[127.0.0.1]:{fleet['stranger'].port}"
    known = fleet.known_hosts_path.read_text()
    assert f"{where} ssh-ed25519" in known
    other_key = fleet["orin-01"].known_hosts_line().split(" ", 1)[1]
    kept = "".join(line for line in known.splitlines(True) if where not in line)
    fleet.known_hosts_path.write_text(kept + f"{where} {other_key}")  # the device's key "changed"
    with pytest.raises(PipelineError, match=r"REFUSED: host key .* does not match the key known_hosts lists"):
        deploy.run(Config(deploy=DeployConfig(inventory=tofu)), two_runs[1], **QUIET)
    assert intact(fleet["stranger"], results(two_runs[0])["stranger"]["release"])


def test_failing_canary_touches_nothing_else(jetson_fleet, two_runs):
    fleet = jetson_fleet(3)
    cfg = fleet_cfg(fleet, policy={"canary": ["orin-02"], "wave_size": 1})
    a = deploy_ok(cfg, two_runs[0])
    fleet["orin-02"].standins.set_trtexec(load_exit=1)
    for target in fleet:
        target.standins.clear_calls()
    with pytest.raises(PipelineError, match=r"orin-02 \(PREFLIGHT_FAILED.*; 2 skipped"):
        deploy.run(cfg, two_runs[1], **QUIET)
    rows = results(two_runs[1])
    assert [rows[n]["status"] for n in ("orin-01", "orin-02", "orin-03")] == ["SKIPPED", "PREFLIGHT_FAILED", "SKIPPED"]
    assert rows["orin-01"]["reason"] == "not tried: the canary failed (orin-02)"
    for target in fleet:
        assert intact(target, a) and os.listdir(target.disk / "releases") == [a]
    assert fleet["orin-01"].standins.calls() == [] and fleet["orin-03"].standins.calls() == []


def test_connection_killed_mid_upload_then_resumed(jetson_fleet, make_two_runs):
    fleet = jetson_fleet([TargetSpec("orin-01", disk_size="200m")])
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet)
    first, second = make_two_runs(size=40_000_000)
    a = deploy_ok(cfg, first)

    def kill_during_upload() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tmp = [p for p in (target.disk / "releases").glob("*.part/model.plan.tmp") if p.stat().st_size > 1_000_000]
            if tmp:
                target.kill()
                return
            time.sleep(0.001)

    killer = threading.Thread(target=kill_during_upload)
    killer.start()
    with pytest.raises(PipelineError, match=r"UPLOAD_FAILED: upload: ") as err:
        deploy.run(cfg, second, **QUIET)
    killer.join()
    assert not target.running, f"the device was not killed during the upload: {err.value}"
    assert isinstance(err.value, TransientError)  # the flow retries it, and the retry resumes the upload
    part = next((target.disk / "releases").glob("*.part"))
    landed = {p.name for p in part.iterdir() if not p.name.endswith(".tmp")}
    target.restart()
    assert intact(target, a) and links(target) == (a, "")

    b = deploy_ok(cfg, second)
    row = results(second)["orin-01"]
    sums = (target.disk / "releases" / b / "SHA256SUMS").read_text().splitlines()
    files = {line.split()[-1] for line in sums} | {"SHA256SUMS"}
    # What landed whole before the cut (several files travel at once) is neither sent again nor linked; the engine,
    # cut mid-way, and SHA256SUMS, sent last, had not landed.
    assert landed and "model.plan" not in landed and "SHA256SUMS" not in landed
    assert row["files_sent"] + row["files_reused"] == len(files - landed) and row["files_sent"] >= 2
    assert row["bytes_sent"] >= 40_000_000 and intact(target, b) and links(target) == (b, a)
    assert not list((target.disk / "releases").glob("*.part"))


def test_cli_plan_run_status_rollback_with_an_inventory(jetson_fleet, two_runs, monkeypatch):
    fleet = jetson_fleet(2)
    inventory = str(fleet.write_inventory(policy={"max_parallel": 1}))
    open_now, most = [0], [0]
    enter, leave = Device.__aenter__, Device.__aexit__

    async def counting_enter(self: Device) -> Device:
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        return await enter(self)

    async def counting_exit(self: Device, *exc: Any) -> None:
        open_now[0] -= 1
        await leave(self, *exc)

    monkeypatch.setattr(Device, "__aenter__", counting_enter)
    monkeypatch.setattr(Device, "__aexit__", counting_exit)
    runner = CliRunner()
    plan = runner.invoke(app, ["deploy", "plan", "--inventory", inventory])
    assert plan.exit_code == 0 and "canary" in plan.output and "wave 1" in plan.output

    ran = runner.invoke(app, ["deploy", "run", "--run-dir", str(two_runs[0].path), "--inventory", inventory])
    assert ran.exit_code == 0, ran.output
    assert "ACTIVE" in ran.output and ORIN in ran.output
    assert json.loads((two_runs[0].path / "config.json").read_text())["deploy"]["inventory"] == inventory

    status = runner.invoke(app, ["deploy", "status", "--inventory", inventory, "--wide"], env={"COLUMNS": "300"})
    assert status.exit_code == 0 and status.output.count(ORIN) == 2 and "36.4.3" in status.output

    back = runner.invoke(app, ["deploy", "rollback", "--inventory", inventory, "--target", "orin-02"])
    assert back.exit_code == 1 and "nothing to roll back to" in back.output
    assert most[0] == 1  # policy.max_parallel caps concurrent connections


@pytest.mark.slow
def test_link_cut_mid_upload_on_a_shaped_link(jetson_fleet, make_two_runs):
    """A pulled cable (no RST, packets dropped) is noticed by keepalives; the device stays on its release."""
    fleet = jetson_fleet([TargetSpec("link-01", network=True)])
    target = fleet["link-01"]
    assert target.link is not None
    cfg = fleet_cfg(fleet)
    first, second = make_two_runs(size=8_000_000)
    a = deploy_ok(cfg, first)
    target.link.shape("16mbit")  # 8 MB takes ~4 s

    def cut_during_upload() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if [p for p in (target.disk / "releases").glob("*.part/model.plan.tmp") if p.stat().st_size > 500_000]:
                target.link.cut()
                return
            time.sleep(0.01)

    cutter = threading.Thread(target=cut_during_upload)
    cutter.start()
    with pytest.raises(PipelineError, match=r"UPLOAD_FAILED: upload: "):
        deploy.run(cfg, second, **QUIET)
    cutter.join()
    target.link.heal()
    target.link.unshape()
    assert intact(target, a) and links(target) == (a, "")
    b = deploy_ok(cfg, second)
    assert intact(target, b) and links(target) == (b, a)


def test_remote_commands_end_on_the_device_at_their_timeout(jetson_fleet):
    fleet = jetson_fleet(1)
    target = load_inventory(fleet.write_inventory()).targets[0]

    async def slow() -> tuple[int, float, str]:
        async with Device(target) as device:
            started = time.perf_counter()
            out = await device.run("echo started; sleep 30", timeout_s=1)
            return out.exit_status, time.perf_counter() - started, out.stdout

    status, seconds, stdout = asyncio.run(slow())
    assert (status, stdout) == (124, "started\n") and seconds < 5  # `timeout` killed it on the device
    assert fleet["orin-01"].run("pgrep -x sleep", check=False).returncode == 1  # nothing left running there


def test_disk_filling_up_during_the_upload(jetson_fleet, make_two_runs, monkeypatch):
    """The space check passed, then the disk filled anyway (another writer): UPLOAD_FAILED, previous release kept."""
    fleet = jetson_fleet([TargetSpec("orin-01", disk_size="2m")])
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet)
    first, second = make_two_runs(size=1_900_000)
    a = deploy_ok(cfg, first)
    monkeypatch.setattr(remote, "_refuse_space", lambda release, facts: None)
    with pytest.raises(PipelineError, match=r"UPLOAD_FAILED: upload: SFTPFailure.*\(disk full\?\)"):
        deploy.run(cfg, second, **QUIET)
    assert intact(target, a) and links(target) == (a, "")


def test_only_unreachable_devices_make_a_retryable_failure(jetson_fleet, two_runs):
    fleet = jetson_fleet(2)
    fleet["orin-02"].kill()
    with pytest.raises(TransientError, match="UNREACHABLE"):
        deploy.run(fleet_cfg(fleet, policy={"canary": 1, "max_failure_pct": 60}), two_runs[0], **QUIET)
    assert results(two_runs[0])["orin-01"]["status"] == "ACTIVE"


def test_a_local_target_and_a_device_report_the_same_fields(jetson_fleet, two_runs, tmp_path):
    fleet = jetson_fleet(1)
    deploy_ok(fleet_cfg(fleet), two_runs[0])
    device_row = results(two_runs[0])["orin-01"]
    local_cfg = Config(deploy=DeployConfig(targets=[LocalTarget(name="here", root=tmp_path / "here")]))
    deploy_ok(local_cfg, two_runs[1])
    local_row = results(two_runs[1])["here"]
    assert set(local_row) == set(device_row) == {f.name for f in fields(TargetResult)}
    assert (device_row["host"], local_row["host"]) == (f"127.0.0.1:{fleet['orin-01'].port}", "local")
    assert (device_row["device_class"], local_row["device_class"]) == (ORIN, "local")
    assert device_row["health"] == {} and local_row["health"]["passed"]


class CutAfter:
    """Every `Device` drops its real SSH connection once it has done `after` remote steps (a command or a file put),
    so the step after that one fails: a link cut between two steps. `steps` names the steps done so far."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.after: int | None = None
        self.steps: list[str] = []
        run, put = Device.run, Device.put

        async def counted_run(device: Device, command: str, *args: Any, **kwargs: Any) -> Any:
            # The program, past the `NAME=value` environment an activation starts with.
            program = next(word for word in command.split() if not re.fullmatch(r"[A-Z_]+=\S*", word))
            return self._done(device, f"run {program}", await run(device, command, *args, **kwargs))

        async def counted_put(device: Device, local: Path, remote_path: str) -> int:
            return self._done(device, f"put {Path(remote_path).name}", await put(device, local, remote_path))

        monkeypatch.setattr(Device, "run", counted_run)
        monkeypatch.setattr(Device, "put", counted_put)

    def _done(self, device: Device, step: str, result: Any) -> Any:
        self.steps.append(step)
        if len(self.steps) == self.after:
            device.conn.abort()  # no goodbye: what the device has done so far is all it gets
        return result

    def deploy(self, cfg: Config, run: RunDir, after: int | None) -> None:
        """One deploy cut after `after` steps (None: not cut); raises what the deploy raises."""
        self.after, self.steps = after, []
        try:
            deploy.run(cfg, run, **QUIET)
        finally:
            self.after = None


def whole_release(target: JetsonTarget) -> str:
    """The release `current` points at, after checking on the device that every file matches its SHA256SUMS."""
    check = target.run("cd /opt/edge/current && sha256sum -c SHA256SUMS >/dev/null && readlink /opt/edge/current")
    return check.stdout.strip().removeprefix("releases/")


def cut_at_each(
    fleet: JetsonFleet, runs: tuple[RunDir, RunDir], cut: CutAfter, pick: Callable[[list[str]], list[int]]
) -> list[str]:
    """Deploy the second release onto a device running the first, cut after each step `pick` chooses among the steps a
    whole deploy takes (their indices, from 1), each time from the same start. Each cut must leave `current` on a
    whole release (the old one: the switch is the last step) and the next deploy must converge: ACTIVE on the new
    release, the old one kept as `previous`, no `.part` or set-aside directory left. Returns the steps cut after."""
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet)
    a = deploy_ok(cfg, runs[0])
    target.run("cp -a /opt/edge /root/start")
    restore = "rm -rf /opt/edge/* /opt/edge/.[!.]* && cp -a /root/start/. /opt/edge/"
    cut.deploy(cfg, runs[1], after=None)
    whole, b = list(cut.steps), results(runs[1])["orin-01"]["release"]
    assert any(s.startswith("put ") for s in whole) and whole[-1] == "run sh"  # uploads ..., then activate.sh
    for k in pick(whole):
        where = f"cut after step {k} of {len(whole)} ({whole[k - 1]})"
        target.run(restore)
        with pytest.raises(PipelineError, match="orin-01"):
            cut.deploy(cfg, runs[1], after=k)
        # The same commands as the whole deploy up to the cut; files travel several at once, so the puts may end in
        # another order, and one already through when the link went is counted after the cut.
        commands = [s for s in cut.steps if not s.startswith("put ")]
        assert commands == [s for s in whole[:k] if not s.startswith("put ")], where
        assert len(cut.steps) >= k and set(cut.steps) <= set(whole), where
        assert whole_release(target) == a and links(target) == (a, ""), where
        cut.deploy(cfg, runs[1], after=None)
        row = results(runs[1])["orin-01"]
        assert (row["status"], row["current"]) == ("ACTIVE", b), f"{where}: {row['reason']}"
        assert whole_release(target) == b and links(target) == (b, a), where
        assert sorted(os.listdir(target.disk / "releases")) == sorted([a, b]), where
    return [whole[k - 1] for k in pick(whole)]


def test_a_deploy_cut_mid_upload_or_before_the_switch_converges(jetson_fleet, two_runs, monkeypatch):
    """Two of the cut points of the slow test below: after the first file sent, and right before activate.sh."""
    cut = CutAfter(monkeypatch)
    done = cut_at_each(jetson_fleet(1), two_runs, cut, lambda s: [[x[:3] for x in s].index("put") + 1, len(s) - 1])
    assert done[0].startswith("put ") and done[1] == "run cd"  # the rename of `.part`


@pytest.mark.slow
def test_a_deploy_cut_after_any_remote_step_converges(jetson_fleet, two_runs, monkeypatch):
    """Every step of a deploy in turn: the link is cut after it, so the next one fails."""
    cut = CutAfter(monkeypatch)
    done = cut_at_each(jetson_fleet(1), two_runs, cut, lambda steps: list(range(1, len(steps))))
    assert len(done) >= 10 and sum(s.startswith("put ") for s in done) >= 3


def test_a_deploy_publishes_only_what_is_on_disk(jetson_fleet, two_runs):
    """The device's side of a deploy under strace (its sshd and all it starts): the release's `.part` is renamed only
    once its files and entries are fsynced, and `current` is switched only once that rename is on disk."""
    fleet = jetson_fleet(1)
    target = fleet["orin-01"]
    cfg = fleet_cfg(fleet)
    a = deploy_ok(cfg, two_runs[0])
    log, there = target.dir / "control/deploy.strace", "/run/standin/deploy.strace"  # the device's view of control/
    with durability.attached(1, log, enter=[tool("nsenter"), "-t", str(target.pid), "-m", "-p"], log_there=there):
        b = deploy_ok(cfg, two_runs[1])
    assert links(target) == (b, a)
    root = Path(target.deploy_root)
    assert durability.publishes(log, root) >= 3  # releases/<b>, current, previous: the trace saw them
    assert durability.unsynced_publishes(log, root, disk=target.disk) == []
