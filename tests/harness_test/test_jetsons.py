"""The stand-in Jetson harness itself, driven the way deploy code will drive it: asyncssh with known_hosts checks."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import (
    XAVIER_NX_JP513,
    JetsonFleet,
    TargetSpec,
    fixtures,
    jetsons,
    network,
    read_plan,
    skip_unless_available,
)

asyncssh = pytest.importorskip("asyncssh")

DPKG = "dpkg-query -W -f='${Package} ${Version}\\n' nvidia-jetpack tensorrt"
TRTEXEC = "/usr/src/tensorrt/bin/trtexec"
jetson_fleet = fixtures.jetson_fleet  # the factory fixture, used here as a deploy test would use it


def _harness_pids() -> set[int]:
    """sshd servers, unshare parents and namespace holders ("sleep infinity") on this machine."""
    out = subprocess.run(["pgrep", "-f", "sshd|unshare|sleep infinity"], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


@pytest.fixture(scope="module")
def no_leaks() -> Iterator[None]:
    """Fails the module's teardown if any harness process started during it outlives its fleet."""
    before = _harness_pids()
    yield
    assert _harness_pids() - before == set()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, no_leaks: None) -> Iterator[JetsonFleet]:
    """Three trusted devices (one a Xavier NX on JetPack 5.1.3 with a 2 MB deploy root) and one unknown to SSH."""
    skip_unless_available()
    specs = [
        TargetSpec("orin-01"),
        TargetSpec("orin-02"),
        TargetSpec("nx-01", board=XAVIER_NX_JP513, disk_size="2m"),
        TargetSpec("stranger", in_known_hosts=False),
    ]
    with JetsonFleet(tmp_path_factory.mktemp("jetsons"), specs) as started:
        yield started


async def _ssh(target: jetsons.JetsonTarget, command: str) -> asyncssh.SSHCompletedProcess:
    async with asyncssh.connect(**target.connect_kwargs()) as conn:
        return await conn.run(command, check=False)


def test_fleet_starts_every_device_on_a_port_of_its_own(fleet: JetsonFleet) -> None:
    # How fast it starts is not asserted: this machine is shared, and timed asserts only measure its load.
    assert all(t.running for t in fleet)
    assert len({t.port for t in fleet}) == 4


def test_three_devices_identify_themselves_over_verified_ssh(fleet: JetsonFleet) -> None:
    trusted = [fleet["orin-01"], fleet["orin-02"], fleet["nx-01"]]
    command = "hostname; head -1 /etc/nv_tegra_release; tr -d '\\0' </sys/firmware/devicetree/base/model; echo; " + DPKG

    async def probe_all() -> list[asyncssh.SSHCompletedProcess]:
        return await asyncio.gather(*(_ssh(t, command) for t in trusted))

    results = asyncio.run(probe_all())
    lines = [r.stdout.splitlines() for r in results]
    assert [r.exit_status for r in results] == [0, 0, 0]
    assert [line[0] for line in lines] == ["orin-01", "orin-02", "nx-01"]
    assert lines[0][1].startswith("# R36 (release), REVISION: 4.3")
    assert lines[2][1].startswith("# R35 (release), REVISION: 5.0")
    assert lines[0][2] == "NVIDIA Jetson AGX Orin Developer Kit"
    assert lines[2][2] == "NVIDIA Jetson Xavier NX Developer Kit"
    assert lines[0][3:] == ["nvidia-jetpack 6.2+b77", "tensorrt 10.3.0.30-1+cuda12.5"]
    assert lines[2][3:] == ["nvidia-jetpack 5.1.3-b29", "tensorrt 8.5.2.2-1+cuda11.4"]
    assert fleet["orin-01"].standins.calls("dpkg-query")[-1][1:] == [
        "-W",
        "-f=${Package} ${Version}\\n",
        "nvidia-jetpack",
        "tensorrt",
    ]


def test_thermal_zone_and_package_knobs_apply_to_a_running_device(fleet: JetsonFleet) -> None:
    target = fleet["orin-02"]
    target.set_temperature("gpu-thermal", 71.5)
    target.standins.set_packages({"tensorrt": None})
    try:
        out = target.run("cat /sys/class/thermal/thermal_zone1/type /sys/class/thermal/thermal_zone1/temp").stdout
        missing = asyncio.run(_ssh(target, DPKG))
    finally:
        target.standins.set_packages(target.spec.board.packages)
    assert out.split() == ["gpu-thermal", "71500"]
    assert missing.exit_status == 1
    assert missing.stdout == "nvidia-jetpack 6.2+b77\n"
    assert "no packages found matching tensorrt" in missing.stderr


def test_trtexec_builds_an_engine_tied_to_its_tensorrt_version(fleet: JetsonFleet) -> None:
    orin, nx = fleet["orin-01"], fleet["nx-01"]
    onnx = b"stand-in onnx bytes" * 100
    build = f"{TRTEXEC} --onnx=/opt/edge/m.onnx --saveEngine=/opt/edge/m.plan --memPoolSize=workspace:512"

    async def build_and_check() -> tuple[asyncssh.SSHCompletedProcess, ...]:
        async with asyncssh.connect(**orin.connect_kwargs()) as conn, conn.start_sftp_client() as sftp:
            async with sftp.open("/opt/edge/m.onnx", "wb") as fh:
                await fh.write(onnx)
            built = await conn.run(build, check=False)
            version = await conn.run(f"{TRTEXEC} --getPlanVersionOnly --loadEngine=/opt/edge/m.plan", check=False)
            return built, version

    built, version = asyncio.run(build_and_check())
    assert built.exit_status == 0
    assert built.stdout.startswith(f"&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # {build}\n")
    assert built.stdout.rstrip().endswith(f"&&&& PASSED TensorRT.trtexec [TensorRT v100300] # {build}")
    assert "Plan was created with TensorRT version 10.3.0.30" in version.stdout
    plan = (orin.disk / "m.plan").read_bytes()
    assert read_plan(plan) is not None
    assert read_plan(plan)[1]["onnx_sha256"] == hashlib.sha256(onnx).hexdigest()
    assert orin.standins.calls("trtexec")[-2] == [TRTEXEC, *build.split()[1:]]

    (nx.disk / "m.plan").write_bytes(plan)
    on_nx = asyncio.run(_ssh(nx, f"{TRTEXEC} --loadEngine=/opt/edge/m.plan"))
    assert on_nx.exit_status == 1
    assert "Version tag does not match" in on_nx.stderr and "&&&& FAILED" in on_nx.stdout


def test_trtexec_knobs_force_a_failed_build(fleet: JetsonFleet) -> None:
    target = fleet["orin-02"]
    target.run("echo onnx > /opt/edge/bad.onnx")
    target.standins.set_trtexec(build_exit=1, error="Error[2]: Requested amount of GPU memory could not be allocated")
    try:
        failed = asyncio.run(_ssh(target, f"{TRTEXEC} --onnx=/opt/edge/bad.onnx --saveEngine=/opt/edge/bad.plan"))
    finally:
        target.standins.set_trtexec(build_exit=0, error="")
    assert failed.exit_status == 1
    assert "GPU memory could not be allocated" in failed.stderr and "&&&& FAILED" in failed.stdout
    assert not (target.disk / "bad.plan").exists()


def test_systemctl_standin_follows_its_unit_knobs(fleet: JetsonFleet) -> None:
    target = fleet["orin-01"]
    target.standins.set_unit("edge-infer", healthy=False)
    target.standins.set_unit("edge-broken.service", restart_exit=1)
    command = (
        "systemctl restart edge-infer; echo rc=$?; systemctl is-active edge-infer; echo rc=$?; "
        "systemctl restart edge-broken; echo rc=$?; systemctl restart nope; echo rc=$?"
    )
    result = asyncio.run(_ssh(target, command))
    assert result.stdout.split() == ["rc=0", "failed", "rc=3", "rc=1", "rc=5"]
    assert "Unit nope.service not found" in result.stderr
    assert target.standins.unit_state("edge-broken") == "failed"
    assert ["/usr/local/bin/systemctl", "restart", "edge-infer"] in target.standins.calls("systemctl")


def test_writing_past_the_deploy_root_size_fails_with_disk_full(fleet: JetsonFleet) -> None:
    target = fleet["nx-01"]

    async def fill() -> tuple[asyncssh.SSHCompletedProcess, BaseException | None]:
        async with asyncssh.connect(**target.connect_kwargs()) as conn:
            shell = await conn.run("head -c 3000000 /dev/zero > /opt/edge/big; echo rc=$?", check=False)
            await conn.run("rm -f /opt/edge/big")
            try:
                async with conn.start_sftp_client() as sftp, sftp.open("/opt/edge/big2", "wb") as fh:
                    await fh.write(bytes(3_000_000))
            except asyncssh.SFTPError as err:
                return shell, err
            return shell, None

    shell, sftp_error = asyncio.run(fill())
    assert shell.stdout.strip() == "rc=1"
    assert "No space left on device" in shell.stderr
    assert isinstance(sftp_error, asyncssh.SFTPFailure)
    assert target.run("df -k /opt/edge | tail -1").stdout.split()[1] == "2048"
    target.resize_disk("4m")
    try:
        grown = asyncio.run(_ssh(target, "rm -f /opt/edge/big2; head -c 3000000 /dev/zero > /opt/edge/big"))
    finally:
        target.run("rm -f /opt/edge/big")
        target.resize_disk("2m")
    assert grown.exit_status == 0


def test_device_missing_from_known_hosts_is_rejected(fleet: JetsonFleet) -> None:
    target = fleet["stranger"]

    async def connect(**overrides: object) -> str:
        async with asyncssh.connect(**{**target.connect_kwargs(), **overrides}) as conn:
            return (await conn.run("hostname", check=True)).stdout.strip()

    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        asyncio.run(connect())
    # The device itself is fine: only the missing host key stopped the first connection.
    assert asyncio.run(connect(known_hosts=None)) == "stranger"


def test_killed_device_drops_its_session_and_refuses_then_restarts(fleet: JetsonFleet) -> None:
    target = fleet["orin-02"]
    target.run("echo kept > /opt/edge/marker")
    target.path("/etc/edge.conf").write_text("mode = canary\n")

    async def session_during_kill() -> tuple[asyncssh.SSHCompletedProcess, float]:
        async with asyncssh.connect(**target.connect_kwargs()) as conn:
            process = await conn.create_process("echo started; sleep 30")
            assert (await process.stdout.readline()) == "started\n"
            killed = time.perf_counter()
            target.kill()
            ended = await asyncio.wait_for(process.wait(), timeout=5)
            waited = time.perf_counter() - killed
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.run("true")
            return ended, waited

    ended, waited = asyncio.run(session_during_kill())
    assert ended.exit_status is None and ended.exit_signal is None  # the connection died, not the command
    assert waited < 2
    assert not target.running
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(_ssh(target, "true"))

    target.restart()
    after = asyncio.run(_ssh(target, "hostname; cat /opt/edge/marker /etc/edge.conf; ls /tmp | wc -l"))
    assert after.stdout.splitlines() == ["orin-02", "kept", "mode = canary", "0"]
    assert not Path("/etc/edge.conf").exists()


def test_inventory_lists_the_fleet_in_the_deploy_shape(fleet: JetsonFleet, tmp_path: Path) -> None:
    path = fleet.write_inventory(
        tmp_path / "fleet.toml", names=["orin-01", "nx-01"], policy={"wave_size": 2}, extra={"nx-01": {"tags": ["nx"]}}
    )
    inventory = tomllib.loads(path.read_text())
    assert inventory["defaults"] == {
        "user": "root",
        "port": 22,
        "key": str(fleet.key_path),
        "known_hosts": str(fleet.known_hosts_path),
        "root": "/opt/edge",
        "service": "",
        "health_command": "",
    }
    assert inventory["policy"] == {
        "canary": 1,
        "wave_size": 2,
        "max_parallel": 8,
        "max_failure_pct": 25,
        "keep_releases": 3,
        "timeout_s": 300,
    }
    assert inventory["targets"] == [
        {"name": "orin-01", "host": "127.0.0.1", "port": fleet["orin-01"].port},
        {"name": "nx-01", "host": "127.0.0.1", "port": fleet["nx-01"].port, "tags": ["nx"]},
    ]


def test_known_hosts_names_each_trusted_device_by_port(fleet: JetsonFleet) -> None:
    lines = fleet.known_hosts_path.read_text().splitlines()
    assert [line.split()[0] for line in lines] == [
        f"[127.0.0.1]:{fleet[n].port}" for n in ("orin-01", "orin-02", "nx-01")
    ]
    assert all(line.split()[1] == "ssh-ed25519" for line in lines)


def test_unavailable_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = jetsons.harness_unavailable.__wrapped__
    monkeypatch.setattr(jetsons.os, "geteuid", lambda: 1000)
    assert "need root" in probe()
    monkeypatch.setattr(jetsons.os, "geteuid", lambda: 0)
    monkeypatch.setattr(jetsons, "which", lambda tool: None if tool == "sshd" else f"/usr/bin/{tool}")
    assert probe() == "stand-in Jetsons need sshd: apt-get install openssh-server"


def test_factory_fixture_serves_openssh_clients_too(jetson_fleet) -> None:
    target = jetson_fleet(1)["orin-01"]
    result = subprocess.run(target.ssh_argv("hostname"), capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, "orin-01\n")


async def _connect_s(target: jetsons.JetsonTarget, timeout: float) -> float:
    started = time.perf_counter()
    async with asyncssh.connect(**target.connect_kwargs(), connect_timeout=timeout):
        return time.perf_counter() - started


async def _upload_s(target: jetsons.JetsonTarget, size: int) -> float:
    async with asyncssh.connect(**target.connect_kwargs()) as conn, conn.start_sftp_client() as sftp:
        started = time.perf_counter()
        async with sftp.open("/opt/edge/blob", "wb") as fh:
            await fh.write(bytes(size))
        return time.perf_counter() - started


def test_private_link_can_be_shaped_cut_and_healed(tmp_path: Path) -> None:
    skip_unless_available(network=True)
    with JetsonFleet(tmp_path / "fleet", [TargetSpec("link-01", network=True)]) as fleet:
        target = fleet["link-01"]
        link = target.link
        assert link is not None and target.port == 22
        assert ipaddress.ip_address(target.host) in network.RANGE
        assert fleet.known_hosts_path.read_text().startswith(f"{target.host} ssh-ed25519 ")

        unshaped = asyncio.run(_upload_s(target, 1_000_000))
        link.shape("16mbit")  # 1 MB takes 0.5 s at 16 Mbit/s
        shaped = asyncio.run(_upload_s(target, 1_000_000))
        link.unshape()
        assert shaped > 0.4 and unshaped < shaped / 2

        link.cut()
        with pytest.raises(TimeoutError):
            asyncio.run(_connect_s(target, timeout=0.5))
        link.heal()
        assert asyncio.run(_connect_s(target, timeout=5)) < 1
        host_if = link.host_if
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert not Path(f"/sys/class/net/{host_if}").exists()
    assert str(network.RANGE) not in routes
