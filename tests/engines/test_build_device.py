"""On-device builds over SSH against the harness's stand-in Jetsons (real sshd; stand-in trtexec at
/usr/src/tensorrt/bin/trtexec that writes engines recording the ONNX file, the SoC and its argv)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import asyncssh
import pytest

from pipeline import engines
from pipeline.config import BuildClass, BuildConfig, Config, DeployConfig, ExportConfig
from pipeline.errors import PipelineError, TransientError
from pipeline.fleet.classes import from_facts
from pipeline.fleet.probe import Facts
from pipeline.manifest import RunDir
from tests.harness import XAVIER_NX_JP513, TargetSpec, fixtures
from tests.harness.inventory import write_inventory
from tests.harness.standin_tools import read_plan

jetson_fleet = fixtures.jetson_fleet
MakeRun = Callable[[Config], RunDir]
QUIET = {"log": lambda _: None}
ORIN, XAVIER = "orin-sm87-trt10.3.0", "xavier-sm72-trt8.5.2"


def test_class_from_probe_facts():
    facts = Facts(model="NVIDIA Jetson AGX Orin", soc="nvidia,tegra234", l4t="36.4.3", tensorrt="10.3.0")
    klass = from_facts(facts, "orin-01")
    assert (klass.name, klass.sm, klass.tensorrt, klass.l4t) == (ORIN, "sm87", "10.3.0", "36.4.3")
    assert (klass.builder, klass.target) == ("device", "orin-01")
    with pytest.raises(PipelineError, match="orin-02: the probe found no TensorRT package"):
        from_facts(Facts(soc="nvidia,tegra234"), "orin-02")


def test_fleet_classes_are_built_on_their_devices(make_run: MakeRun, jetson_fleet, tmp_path: Path):
    fleet = jetson_fleet([TargetSpec("orin-01"), TargetSpec("orin-02"), TargetSpec("xavier-01", board=XAVIER_NX_JP513)])
    build_cfg = BuildConfig(from_inventory=True, cache_dir=tmp_path / "cache", workspace_mb=512, timeout_s=60)
    cfg = Config(
        build=build_cfg,
        export=ExportConfig(max_batch=8, opt_batch=4),
        deploy=DeployConfig(inventory=fleet.write_inventory()),
    )
    run = make_run(cfg)
    result = engines.run(cfg, run, **QUIET)

    assert result.status == "done" and set(result.metrics["classes"]) == {ORIN, XAVIER}
    onnx_sha = hashlib.sha256((run.path / "onnx/model.onnx").read_bytes()).hexdigest()
    for name, target, soc, version in (
        (ORIN, "orin-01", "nvidia,tegra234", "10.3.0.30"),
        (XAVIER, "xavier-01", "nvidia,tegra194", "8.5.2.2"),
    ):
        plan = read_plan((run.path / f"engines/{name}/model.plan").read_bytes())
        assert plan is not None
        built_with, meta = plan
        assert built_with == version and meta["soc"] == soc and meta["hostname"] == target
        assert meta["onnx_sha256"] == onnx_sha
        assert "--memPoolSize=workspace:512" in meta["argv"] and "--fp16" in meta["argv"]
        calls = fleet[target].standins.calls("trtexec")
        assert all(argv[0] == "/usr/src/tensorrt/bin/trtexec" for argv in calls)
        assert fleet[target].run("ls /tmp", check=False).stdout.strip() == ""  # the work directory is gone
    assert "--skipInference" in read_plan((run.path / f"engines/{ORIN}/model.plan").read_bytes())[1]["argv"]
    assert "--buildOnly" in read_plan((run.path / f"engines/{XAVIER}/model.plan").read_bytes())[1]["argv"]
    # One build per class, on the first device; the class's second device loads it to verify it.
    assert not any(a.startswith("--onnx=") for argv in fleet["orin-02"].standins.calls("trtexec") for a in argv)
    assert any("--exportOutput=" in " ".join(argv) for argv in fleet["orin-02"].standins.calls("trtexec"))
    assert not any("--getPlanVersionOnly" in argv for argv in fleet["xavier-01"].standins.calls("trtexec"))
    orin, xavier = result.metrics["classes"][ORIN], result.metrics["classes"][XAVIER]
    assert orin["verified"] and orin["latency"]["median_ms"] == 1.22 and orin["latency"]["throughput_qps"] == 812.4
    assert (orin["built_by"], orin["verified_by"]) == ("orin-01", "orin-02")
    assert (xavier["built_by"], xavier["verified_by"]) == ("xavier-01", None)  # alone in its class
    assert json.loads((run.path / f"engines/{XAVIER}/build.json").read_text())["peer_check"] == "unverified by a peer"
    assert list((tmp_path / "cache").glob(f"{ORIN}/*/model.plan")) and not (tmp_path / "cache" / XAVIER).exists()

    builds = len(fleet["orin-01"].standins.calls("trtexec"))
    again = engines.run(cfg, run, **QUIET)
    assert again.metrics["cache_hits"] == 1 and len(fleet["orin-01"].standins.calls("trtexec")) == builds
    assert again.metrics["classes"][XAVIER]["status"] == "built"  # no shared cache entry: built again

    fleet["orin-01"].standins.set_trtexec(
        build_exit=1, error="Error[2]: Requested amount of GPU memory could not be allocated"
    )
    cfg.build.workspace_mb = 256  # a new key: must build, and fails
    failed = r"orin-sm87-trt10\.3\.0: build: trtexec on device orin-01 exited with status 1: .*Error\[2\]: Requested"
    with pytest.raises(PipelineError, match=failed):
        engines.run(cfg, run, **QUIET)


def test_an_unreachable_build_device_is_transient(make_run: MakeRun, tmp_path: Path):
    """Nothing listens where the build device should be: the stage fails with a TransientError (the flow retries
    that, and only that), instead of reporting the class "not built" and letting deploy ship ONNX only."""
    key = tmp_path / "id_ed25519"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(key), "pkcs8-pem")
    (tmp_path / "known_hosts").write_text("")
    inventory = write_inventory(
        tmp_path / "fleet.toml",
        {"key": str(key), "known_hosts": str(tmp_path / "known_hosts")},
        {},
        [{"name": "orin-01", "host": "127.0.0.1", "port": 9}],
    )
    klass = BuildClass(name=ORIN, tensorrt="10.3.0", sm="sm87", builder="device", target="orin-01")
    cfg = Config(
        build=BuildConfig(classes=[klass], cache_dir=tmp_path / "cache"), deploy=DeployConfig(inventory=inventory)
    )
    with pytest.raises(TransientError, match=rf"class\(es\) failed: {ORIN}: build device orin-01 unreachable: "):
        engines.run(cfg, make_run(cfg), **QUIET)


def test_a_device_reporting_facts_no_class_can_hold_is_left_out_not_fatal():
    """A prerelease TensorRT (`10.3.0~rc1`), a hostile one or an unknown SoC is one line naming the device, quoting
    at most 40 characters of what it reported, never a traceback."""
    with pytest.raises(PipelineError, match=r"^orin-01: reports TensorRT '10\.3\.0~rc1', not a version this pipeline"):
        from_facts(Facts(soc="nvidia,tegra234", tensorrt="10.3.0~rc1"), "orin-01")
    for hostile in ("$(id)", "1" * 500 + "\n\x1b[2J"):
        with pytest.raises(PipelineError, match=r"^orin-01: reports TensorRT ") as err:
            from_facts(Facts(soc="nvidia,tegra234", tensorrt=hostile), "orin-01")
        assert repr(hostile[:40] + ("..." if len(hostile) > 40 else "")) in str(err.value)
        assert len(str(err.value)) < 160 and "\n" not in str(err.value) and "\x1b" not in str(err.value)
    with pytest.raises(PipelineError, match=r"cam-07: unknown SoC 'nvidia,tegra999' \('Jetson Next'\)"):
        from_facts(Facts(model="Jetson Next", soc="nvidia,tegra999", tensorrt="10.3.0"), "cam-07")
