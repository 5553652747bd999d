"""Install-time engine builds against stand-in Jetsons (real sshd per device; the stand-in trtexec refuses options
its TensorRT version lacks and writes engines recording their version, ONNX file, SoC and device)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnxconverter_common import float16

from pipeline import deploy, engines
from pipeline.config import BuildClass, BuildConfig, Config, DeployConfig
from pipeline.errors import PipelineError, TransientError
from pipeline.fleet.ssh import Device
from pipeline.manifest import RunDir
from tests.deploy.test_fleet_ssh import files_on, intact, links, results
from tests.harness import AGX_ORIN_JP62, XAVIER_NX_JP513, JetsonFleet, JetsonTarget, TargetSpec, fixtures, read_plan

pytest.importorskip("asyncssh")

jetson_fleet = fixtures.jetson_fleet
QUIET = {"log": lambda _: None}
ORIN_JP7 = replace(AGX_ORIN_JP62, packages={"nvidia-jetpack": "7.2.2-b40", "tensorrt": "11.4.1.12-1+cuda13.0"})
ORIN_107 = replace(AGX_ORIN_JP62, packages={"nvidia-jetpack": "6.2.1+b38", "tensorrt": "10.7.0.23-1+cuda12.6"})
XAVIER, ORIN, ORIN11, ORIN107 = (
    "xavier-sm72-trt8.5.2",
    "orin-sm87-trt10.3.0",
    "orin-sm87-trt11.4.1",
    "orin-sm87-trt10.7.0",
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def typed_run(make_run: Callable[..., RunDir], onnx_models: list[Path]) -> Callable[[str], RunDir]:
    """typed_run(run_id): a deployable run that also holds onnx/model.fp16.onnx, what TensorRT 11 builds fp16 from."""

    def make(run_id: str) -> RunDir:
        run = make_run(run_id, onnx_models[0])
        typed = float16.convert_float_to_float16(onnx.load(str(run.path / "onnx/model.onnx")), keep_io_types=True)
        onnx.save(typed, str(run.path / "onnx/model.fp16.onnx"))
        return run

    return make


def answer_correctly(fleet: JetsonFleet, run: RunDir) -> None:
    """Make every device's stand-in trtexec export, on a load, the logits ONNX Runtime gave for the stored sample
    (what a correct engine computes), so verification compares real numbers."""
    with np.load(run.path / "onnx/sample.npz") as sample:
        logits = sample["logits"].tolist()
    for target in fleet:
        target.standins.set_trtexec(outputs={"logits": logits})


def config(fleet: JetsonFleet, tmp_path: Path, classes: list[dict[str, Any]], **policy: Any) -> Config:
    build = BuildConfig(classes=classes, cache_dir=tmp_path / "engine-cache", workspace_mb=512, timeout_s=60)
    return Config(build=build, deploy=DeployConfig(inventory=fleet.write_inventory(policy=policy)))


def builds(target: JetsonTarget) -> list[list[str]]:
    """trtexec builds the device ran (calls with --onnx)."""
    return [argv for argv in target.standins.calls("trtexec") if any(a.startswith("--onnx=") for a in argv)]


def running(target: JetsonTarget) -> tuple[str, dict[str, Any]]:
    """(TensorRT version, metadata) of the engine in the device's current release."""
    plan = read_plan((target.disk / "current/model.plan").read_bytes())
    assert plan is not None
    return plan


def test_a_fleet_of_four_versions_every_device_gets_a_working_engine(jetson_fleet, typed_run, tmp_path: Path):
    fleet = jetson_fleet(
        [
            TargetSpec("nx-85", board=XAVIER_NX_JP513),
            TargetSpec("orin-103", board=AGX_ORIN_JP62),
            TargetSpec("orin-114", board=ORIN_JP7),
            TargetSpec("orin-107a", board=ORIN_107),
            TargetSpec("orin-107b", board=ORIN_107),
        ]
    )
    run = typed_run("run-f")
    answer_correctly(fleet, run)
    prebuilt = [
        {"name": XAVIER, "tensorrt": "8.5", "builder": "device", "target": "nx-85"},
        {"name": ORIN, "tensorrt": "10.3", "builder": "device", "target": "orin-103"},
        {"name": ORIN11, "tensorrt": "11.4", "builder": "device", "target": "orin-114"},
    ]
    # The 10.7 class is declared nowhere; its first device (the canary) builds it, the other waits for it.
    cfg = config(fleet, tmp_path, prebuilt, canary=["orin-107a"], wave_size=4)
    assert engines.run(cfg, run, **QUIET).metrics["engines"] == 3
    for target in fleet:
        target.standins.clear_calls()

    result = deploy.run(cfg, run, **QUIET)
    rows = results(run)
    assert {r["status"] for r in rows.values()} == {"ACTIVE"} and result.metrics["built_on_device"] == 1
    fp32, fp16 = sha256(run.path / "onnx/model.onnx"), sha256(run.path / "onnx/model.fp16.onnx")
    for name, klass, onnx_sha in (
        ("nx-85", XAVIER, fp32),
        ("orin-103", ORIN, fp32),
        ("orin-114", ORIN11, fp16),  # strongly typed: built from the fp16 graph, no --fp16
        ("orin-107a", ORIN107, fp32),
        ("orin-107b", ORIN107, fp32),
    ):
        version, meta = running(fleet[name])
        assert version == fleet[name].spec.board.tensorrt and meta["onnx_sha256"] == onnx_sha, name
        assert rows[name]["device_class"] == klass and intact(fleet[name], rows[name]["release"])
    assert "--fp16" not in running(fleet["orin-114"])[1]["argv"] and "--fp16" in running(fleet["nx-85"])[1]["argv"]
    assert len({r["release"] for r in rows.values()}) == 4  # one release per engine: ids name their content

    # The 10.7 engine: built on orin-107a (verified there), back in the run and the engine cache; orin-107b got it
    # by upload, without building.
    built = run.path / f"engines/{ORIN107}"
    info = json.loads((built / "build.json").read_text())
    assert running(fleet["orin-107a"])[1]["hostname"] == "orin-107a"
    assert (built / "model.plan").read_bytes() == (fleet["orin-107b"].disk / "current/model.plan").read_bytes()
    assert (info["builder"], info["target"], info["tensorrt_version"], info["cache"]) == (
        "device",
        "orin-107a",
        "10.7.0",
        "miss",
    )
    assert info["verification"]["plan_version"] == "10.7.0.23" and info["verification"]["outputs"]["passed"]
    assert "--memPoolSize=workspace:512" in info["command"] and "--skipInference" in info["command"]
    assert list((tmp_path / f"engine-cache/{ORIN107}").glob("*/model.plan"))
    assert run.manifest()["stages"]["deploy"]["outputs"][f"engine:{ORIN107}"] == f"engines/{ORIN107}/model.plan"
    a, b = rows["orin-107a"], rows["orin-107b"]
    assert a["built_on_device"] and a["build_seconds"] > 0 and not b["built_on_device"] and b["build_seconds"] == 0
    assert len(builds(fleet["orin-107a"])) == 1 and builds(fleet["orin-107b"]) == []
    assert a["bytes_sent"] < b["bytes_sent"]  # the builder links the engine from its own cache instead
    assert fleet["orin-107a"].run("ls -A /tmp").stdout == ""  # the private build directory is gone
    assert not any(builds(fleet[n]) for n in ("nx-85", "orin-103", "orin-114"))

    # The same run again: nothing built, nothing sent, nothing switched.
    before = {t.name: files_on(t) for t in fleet}
    deploy.run(cfg, run, **QUIET)
    again = results(run)
    assert {(r["status"], r["bytes_sent"], r["reason"], r["built_on_device"]) for r in again.values()} == {
        ("ACTIVE", 0, "already active", False)
    }
    assert all(len(builds(t)) == (1 if t.name == "orin-107a" else 0) for t in fleet)
    assert {t.name: files_on(t) for t in fleet} == before

    # A controller without the engine (another checkout, a wiped cache): the device's own cache has it, no rebuild.
    for gone in (built, tmp_path / "engine-cache" / ORIN107):
        for path in sorted(gone.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    deploy.run(cfg, run, **QUIET)
    info = json.loads((built / "build.json").read_text())
    assert (info["cache"], info["built_by"], info["verified_by"]) == ("device", "orin-107a", "orin-107b")
    assert len(builds(fleet["orin-107a"])) == 1 and builds(fleet["orin-107b"]) == []
    assert {r["status"] for r in results(run).values()} == {"ACTIVE"}


def test_two_devices_of_a_new_class_in_one_wave_build_once(jetson_fleet, typed_run, tmp_path: Path):
    fleet = jetson_fleet([TargetSpec("orin-107a", board=ORIN_107), TargetSpec("orin-107b", board=ORIN_107)])
    run = typed_run("run-w")
    answer_correctly(fleet, run)
    deploy.run(config(fleet, tmp_path, [], canary=0, wave_size=2), run, **QUIET)
    rows = results(run)
    assert sorted(r["built_on_device"] for r in rows.values()) == [False, True]
    assert sum(len(builds(t)) for t in fleet) == 1
    assert running(fleet["orin-107a"]) == running(fleet["orin-107b"])


def test_a_declared_class_uses_its_own_options_and_dla_is_refused_where_there_is_none(
    jetson_fleet, typed_run, tmp_path: Path
):
    fleet = jetson_fleet([TargetSpec("orin-107a", board=ORIN_107), TargetSpec("orin-114", board=ORIN_JP7)])
    run = typed_run("run-d")
    answer_correctly(fleet, run)
    classes = [
        BuildClass(name=ORIN107, tensorrt="10.7", builder="device", workspace_mb=256, dla_core=0).model_dump(),
        BuildClass(name=ORIN11, tensorrt="11.4", builder="device", dla_core=0).model_dump(),
    ]
    cfg = config(fleet, tmp_path, classes, canary=0, max_failure_pct=100)
    fleet["orin-114"].standins.set_packages({"nvidia-jetpack": "7.1.0-b12"})  # DLA on 11.4.1 needs JetPack 7.2.2
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: orin-114 \(REFUSED: "):
        deploy.run(cfg, run, **QUIET)
    rows = results(run)
    assert rows["orin-114"]["reason"] == (
        f"{ORIN11}: dla_core = 0: TensorRT 11.4.1 has DLA only on JetPack 7.2.2 and later (this device runs JetPack "
        "7.1.0)"
    )
    assert builds(fleet["orin-114"]) == [] and not (fleet["orin-114"].disk / "releases").exists()
    (argv,) = builds(fleet["orin-107a"])
    assert "--memPoolSize=workspace:256" in argv and "--useDLACore=0" in argv and "--allowGPUFallback" in argv
    assert rows["orin-107a"]["status"] == "ACTIVE"


def test_a_build_failing_on_the_device_keeps_the_previous_release(
    jetson_fleet, typed_run, make_run, onnx_models, tmp_path: Path
):
    fleet = jetson_fleet([TargetSpec("orin-107a", board=ORIN_107)])
    target = fleet["orin-107a"]
    first = typed_run("run-a")
    answer_correctly(fleet, first)
    cfg = config(fleet, tmp_path, [])
    a = deploy.run(cfg, first, **QUIET).metrics["release"]
    before = files_on(target)

    second = make_run("run-b", onnx_models[1])  # another model: its engine must be built
    target.standins.set_trtexec(build_exit=1, error="Error[2]: Requested amount of GPU memory could not be allocated")
    with pytest.raises(PipelineError, match="BUILD_FAILED") as err:
        deploy.run(cfg, second, **QUIET)
    row = results(second)["orin-107a"]
    failed_log = second.path / "deploy/build-failed/orin-107a.log"
    assert row["status"] == "BUILD_FAILED" and row["current"] == a
    assert row["reason"].startswith("build: trtexec on device orin-107a exited with status 1: ")
    assert "[E] Error[2]: Requested amount of GPU memory could not be allocated (full log:" in row["reason"]
    assert row["reason"].endswith(f"(full log: {failed_log})") and "Error[2]" in failed_log.read_text()
    assert not isinstance(err.value, TransientError)  # a failing build fails the same way on a retry
    assert files_on(target) == before and intact(target, a) and links(target) == (a, "")
    assert target.run("ls -A /tmp").stdout == ""  # the build's temp directory is gone
    assert not (second.path / f"engines/{ORIN107}").exists()


def test_an_onnx_file_damaged_on_its_way_is_never_built(jetson_fleet, typed_run, tmp_path: Path, monkeypatch):
    fleet = jetson_fleet([TargetSpec("orin-107a", board=ORIN_107)])
    target = fleet["orin-107a"]
    put = Device.put

    async def damaging_put(self: Device, local: Path, remote_path: str) -> int:
        sent = await put(self, local, remote_path)
        if "/edge-build." in remote_path and remote_path.endswith("/model.onnx"):  # bit rot in the build directory
            target.run(f"printf X | dd of={remote_path} bs=1 seek=100 conv=notrunc 2>/dev/null")
        return sent

    monkeypatch.setattr(Device, "put", damaging_put)
    message = r"BUILD_FAILED: build: onnx/model\.onnx on device orin-107a does not match its sha256 here"
    with pytest.raises(PipelineError, match=message):
        deploy.run(config(fleet, tmp_path, []), typed_run("run-u"), **QUIET)
    assert builds(target) == [] and target.run("ls -A /tmp").stdout == ""
