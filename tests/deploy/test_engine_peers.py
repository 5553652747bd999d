"""An engine built on a device reaches the engine cache and the class's other devices only once a second device of
the class verified it (pipeline.trt.peer), against stand-in Jetsons whose trtexec, like TensorRT, refuses a plan
whose length is not the one its header records."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline import deploy, engines
from pipeline.config import BuildConfig, Config, DeployConfig
from pipeline.deploy.stage import fleet_releases
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir
from tests.deploy import test_device_build
from tests.deploy.test_device_build import ORIN107, ORIN_107, answer_correctly, builds, running
from tests.deploy.test_fleet_ssh import ORIN, record_engine, results
from tests.harness import JetsonFleet, JetsonTarget, TargetSpec, fixtures

pytest.importorskip("asyncssh")

jetson_fleet = fixtures.jetson_fleet
typed_run = test_device_build.typed_run
PAYLOAD = b"TAMPERED-PAYLOAD"
COMPROMISED = '''{shebang}
"""A compromised trtexec: it builds as the stand-in does and appends a payload to every engine it saves, and vouches
for its own engines (it loads them without the payload)."""
import subprocess, sys
PAYLOAD = {payload!r}
args = sys.argv[1:]
opts = dict(a[2:].partition("=")[::2] for a in args if a.startswith("--"))
if "loadEngine" in opts:
    data = open(opts["loadEngine"], "rb").read()
    if data.endswith(PAYLOAD):
        clean = opts["loadEngine"] + ".clean"
        open(clean, "wb").write(data[: -len(PAYLOAD)])
        args = ["--loadEngine=" + clean if a.startswith("--loadEngine=") else a for a in args]
status = subprocess.call(["/usr/src/tensorrt/real/trtexec", *args])
if status == 0 and "saveEngine" in opts:
    open(opts["saveEngine"], "ab").write(PAYLOAD)
sys.exit(status)
'''


def compromise(target: JetsonTarget) -> None:
    """Put the compromised trtexec where JetPack's is, the stand-in behind it."""
    shebang = target.run("head -1 /usr/src/tensorrt/bin/trtexec").stdout.strip()
    target.run("mkdir /usr/src/tensorrt/real && mv /usr/src/tensorrt/bin/trtexec /usr/src/tensorrt/real/trtexec")
    script = COMPROMISED.format(shebang=shebang, payload=PAYLOAD)
    target.run("cat > /usr/src/tensorrt/bin/trtexec && chmod 755 /usr/src/tensorrt/bin/trtexec", input=script)


def holds_payload(target: JetsonTarget) -> bool:
    """Whether any file under the device's deploy root holds the payload."""
    return target.run(f"grep -rlF {PAYLOAD.decode()} /opt/edge", check=False).stdout != ""


def running_bytes(target: JetsonTarget) -> bytes:
    """The engine of the device's current release."""
    return (target.disk / "current/model.plan").read_bytes()


def config(fleet: JetsonFleet, tmp_path: Path, **policy: object) -> Config:
    build = BuildConfig(cache_dir=tmp_path / "engine-cache", workspace_mb=512, timeout_s=60)
    return Config(build=build, deploy=DeployConfig(inventory=fleet.write_inventory(policy=policy)))


def test_an_engine_a_device_tampered_with_reaches_neither_the_cache_nor_its_peer(
    jetson_fleet, typed_run: Callable[[str], RunDir], tmp_path: Path
):
    fleet = jetson_fleet([TargetSpec("mallory", board=ORIN_107), TargetSpec("honest", board=ORIN_107)])
    run = typed_run("run-t")
    answer_correctly(fleet, run)
    compromise(fleet["mallory"])
    lines: list[str] = []
    # mallory first (alone in its wave), so its engine is the one the class would share.
    cfg = config(fleet, tmp_path, canary=0, wave_size=1, max_failure_pct=100)
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: mallory \(BUILD_FAILED: ") as err:
        deploy.run(cfg, run, log=lines.append)

    rows = results(run)
    rejected = f"{ORIN107}: the engine built on mallory was rejected by honest, another device of the class ("
    assert rejected in rows["mallory"]["reason"] and "not used, not shared" in rows["mallory"]["reason"]
    assert "\n" not in str(err.value) and rejected in str(err.value)
    assert any(line.startswith("[deploy] mallory: BUILD_FAILED") and "honest" in line for line in lines)
    assert len(builds(fleet["mallory"])) == 1 and not (fleet["mallory"].disk / "current").exists()
    # The tampered engine is in no cache, not in the run, nowhere on honest (its load there failed, in a temp dir).
    assert not list((tmp_path / "engine-cache").rglob("model.plan"))
    assert not (run.path / f"engines/{ORIN107}").exists() and not holds_payload(fleet["honest"])
    assert fleet["honest"].run("ls -A /tmp").stdout == ""
    # honest builds its own; mallory, rejected, verifies nothing: honest alone runs it, unverified by a peer.
    assert rows["honest"]["status"] == "ACTIVE" and rows["honest"]["built_on_device"]
    assert running(fleet["honest"])[1]["hostname"] == "honest"
    info = json.loads((fleet["honest"].disk / "current/engine.json").read_text())
    assert (info["built_by"], info["verified_by"], info["peer_check"]) == ("honest", None, "unverified by a peer")
    assert any("honest alone runs it" in line for line in lines)
    assert (run.path / "deploy/unverified/honest/model.plan").read_bytes() == running_bytes(fleet["honest"])
    loads = [argv for argv in fleet["mallory"].standins.calls("trtexec") if any("--loadEngine=" in a for a in argv)]
    assert len(loads) == 2  # its own plan version and load: it verified nothing for honest


def test_a_good_engine_records_its_builder_and_its_verifier_and_only_then_is_shared(
    jetson_fleet, typed_run: Callable[[str], RunDir], tmp_path: Path
):
    fleet = jetson_fleet([TargetSpec("orin-a", board=ORIN_107), TargetSpec("orin-b", board=ORIN_107)])
    run = typed_run("run-g")
    answer_correctly(fleet, run)
    deploy.run(config(fleet, tmp_path, canary=1), run, log=lambda _: None)
    rows = results(run)
    assert {r["status"] for r in rows.values()} == {"ACTIVE"} and len(builds(fleet["orin-a"])) == 1
    assert builds(fleet["orin-b"]) == [] and running(fleet["orin-a"]) == running(fleet["orin-b"])
    for where in (run.path / f"engines/{ORIN107}/build.json", fleet["orin-b"].disk / "current/engine.json"):
        info = json.loads(where.read_text())
        assert (info["built_by"], info["verified_by"]) == ("orin-a", "orin-b"), where
        assert info["peer_check"]["loads"] and info["peer_check"]["outputs"]["passed"]
    (entry,) = (tmp_path / "engine-cache" / ORIN107).glob("*/build.json")
    assert json.loads(entry.read_text())["verified_by"] == "orin-b"
    # orin-b loaded the very bytes the controller fetched: the sha256 it checked is the one published.
    loads = [a for argv in fleet["orin-b"].standins.calls("trtexec") for a in argv if a.startswith("--loadEngine=")]
    assert loads and json.loads(entry.read_text())["engine_sha256"] == info["engine_sha256"]


def test_an_engine_no_peer_verified_goes_to_its_builder_alone(jetson_fleet, typed_run, tmp_path: Path):
    """The build stage builds the class on orin-a while orin-b is not in the inventory: the engine is orin-a's alone
    (not cached); a later deploy to both refuses orin-b that engine, naming its builder."""
    fleet = jetson_fleet([TargetSpec("orin-a", board=ORIN_107), TargetSpec("orin-b", board=ORIN_107)])
    run = typed_run("run-p")
    answer_correctly(fleet, run)
    klass = {"name": ORIN107, "tensorrt": "10.7", "builder": "device", "target": "orin-a"}
    build = BuildConfig(classes=[klass], cache_dir=tmp_path / "engine-cache", timeout_s=60)
    alone = Config(build=build, deploy=DeployConfig(inventory=fleet.write_inventory(names=["orin-a"])))
    row = engines.run(alone, run, log=lambda _: None).metrics["classes"][ORIN107]
    assert (row["status"], row["built_by"], row["verified_by"]) == ("built", "orin-a", None)
    assert not (tmp_path / "engine-cache" / ORIN107).exists()

    both = Config(build=build, deploy=DeployConfig(inventory=fleet.write_inventory(policy={"max_failure_pct": 100})))
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: orin-b \(REFUSED: "):
        deploy.run(both, run, log=lambda _: None)
    rows = results(run)
    assert rows["orin-a"]["status"] == "ACTIVE" and rows["orin-b"]["bytes_sent"] == 0
    assert rows["orin-b"]["reason"].startswith(
        f"the {ORIN107} engine was built on orin-a and is unverified by a peer: only orin-a runs it"
    )


def test_a_device_cache_entry_naming_another_class_is_never_published(jetson_fleet, typed_run, tmp_path: Path):
    """A device's cache is the device's word: its build.json naming a class like `../escaped` (a path out of the engine
    cache) or a verifier is not taken; the device builds afresh."""
    fleet = jetson_fleet([TargetSpec("orin-a", board=ORIN_107)])
    target = fleet["orin-a"]
    run = typed_run("run-c")
    answer_correctly(fleet, run)
    cfg = config(fleet, tmp_path)
    deploy.run(cfg, run, log=lambda _: None)
    (entry,) = (target.disk / "engine-cache").glob("*/build.json")
    forged = {**json.loads(entry.read_text()), "class": "../escaped", "verified_by": "orin-z"}
    target.run(f"cat > /opt/edge/engine-cache/{entry.parent.name}/build.json", input=json.dumps(forged))
    deploy.run(cfg, run, log=lambda _: None)
    assert len(builds(target)) == 2 and not (tmp_path / "escaped").exists()
    assert not (tmp_path / "engine-cache").exists()
    info = json.loads((target.disk / "current/engine.json").read_text())
    assert (info["class"], info["verified_by"], info["cache"]) == (ORIN107, None, "miss")


def test_a_recorded_engine_whose_build_json_is_no_object_is_refused_before_any_device(make_run, onnx_models):
    run = make_run("run-j", onnx_models[0])
    record_engine(run)
    (run.path / f"engines/{ORIN}/build.json").write_text("[]")
    with pytest.raises(PipelineError, match=rf"engines/{ORIN}/build\.json: not a JSON object \(run `pipeline build`"):
        fleet_releases(run)


def test_a_peer_that_cannot_verify_gives_no_verdict_and_blames_nobody(jetson_fleet, typed_run, tmp_path: Path):
    """orin-b cannot make a work directory (its /tmp is read-only): it says nothing of orin-a's engine, which orin-a
    then runs alone, unverified; orin-a is no suspect, and orin-b fails its own build on its own account."""
    fleet = jetson_fleet([TargetSpec("orin-a", board=ORIN_107), TargetSpec("orin-b", board=ORIN_107)])
    run = typed_run("run-n")
    answer_correctly(fleet, run)
    fleet["orin-b"].run("mount -o remount,ro /tmp")
    lines: list[str] = []
    with pytest.raises(PipelineError, match=r"1 of 2 targets not active: orin-b \(BUILD_FAILED: "):
        deploy.run(config(fleet, tmp_path, canary=1, max_failure_pct=100), run, log=lines.append)
    assert any(line.startswith("[peer] orin-b: cannot verify the engine built on orin-a: ") for line in lines)
    rows = results(run)
    assert rows["orin-a"]["status"] == "ACTIVE" and "cannot create a temp directory" in rows["orin-b"]["reason"]
    info = json.loads((fleet["orin-a"].disk / "current/engine.json").read_text())
    assert (info["built_by"], info["verified_by"], info["peer_check"]) == ("orin-a", None, "unverified by a peer")
    assert not (tmp_path / "engine-cache").exists()
