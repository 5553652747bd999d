"""The deploy stage: release the run's model to every configured target and report per target.

Targets are local directories, or, when `deploy.inventory` names an inventory, SSH devices rolled out to in
waves; both go through the same target-side steps (`remote`, `activate.sh`). A device whose class has no engine in
the run gets one built at install time (`device_build`); those engines land in `engines/<class>/` and are the
stage's outputs too. Not cacheable: the truth is on the targets (someone may have rolled back or wiped one since the
last run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pipeline.config import Config
from pipeline.deploy import remote
from pipeline.deploy.device_build import DeviceBuilds
from pipeline.deploy.hosts import LocalHost, local_spot
from pipeline.deploy.release import HostRelease, Releases, engine_info, make_release
from pipeline.deploy.result import ACTIVE, UNREACHABLE, UPLOAD_FAILED, TargetResult, results_table
from pipeline.deploy.rollout import rollout, waves
from pipeline.errors import PipelineError, TransientError
from pipeline.files import write_json
from pipeline.fleet.classes import host_class
from pipeline.fleet.inventory import Policy, load_inventory
from pipeline.layout import (
    ACTIVATE,
    BUILD_INFO_KEY,
    DEPLOY_PLAN,
    DEPLOY_RESULTS,
    ENGINE_KEY,
    MANIFEST,
    MODEL_JSON,
    ONNX,
    PLAN,
    SAMPLE,
    class_of_engine_key,
    engine_keys,
)
from pipeline.manifest import RunDir, Stage, StageResult, run_stage

ACTIVATE_SCRIPT = Path(__file__).with_name("activate.sh")


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Deploy to `cfg.deploy.targets`; writes deploy/results.json, and raises PipelineError if any target failed."""
    return run_stage(run, cfg, STAGE, lambda: _body(cfg, run, log), log, cacheable=False)


def local_engine(run: RunDir) -> tuple[Path, Path] | None:
    """(model.plan, build.json) of the engine the build stage made for this host, None when it made none."""
    engine = recorded_engine(run)
    if engine is None or host_class(str(engine_info(engine[1]).get("class", ""))) is None:
        return None
    return engine


def recorded_engine(run: RunDir) -> tuple[Path, Path] | None:
    """(model.plan, build.json) of the engine the build stage recorded (for any device class), None when none."""
    entry = run.manifest()["stages"].get("build")
    if not entry or entry.get("status") not in ("done", "cached"):
        return None
    outputs = entry.get("outputs", {})
    if ENGINE_KEY not in outputs or BUILD_INFO_KEY not in outputs:
        return None
    plan, info = inside(run, outputs[ENGINE_KEY]), inside(run, outputs[BUILD_INFO_KEY])
    if not plan.is_file():
        raise PipelineError(f"{plan}: the build stage recorded this engine but it is missing (run `pipeline build`)")
    return plan, info


def recorded_engines(run: RunDir) -> dict[str, tuple[Path, Path]]:
    """Device class → (model.plan, build.json) of every engine the build stage recorded (`engine:<class>` outputs,
    or its single `engine` with the class from build.json)."""
    entry = run.manifest()["stages"].get("build")
    if not entry or entry.get("status") not in ("done", "cached"):
        return {}
    outputs = entry.get("outputs", {})
    engines = {
        klass: (inside(run, path), inside(run, outputs.get(engine_keys(klass)[1], "")))
        for key, path in outputs.items()
        if (klass := class_of_engine_key(key)) is not None
    }
    if not engines and (single := recorded_engine(run)) is not None:
        engines[str(engine_info(single[1]).get("class", "unknown"))] = single
    for plan, info in engines.values():
        if not plan.is_file() or not info.is_file():
            raise PipelineError(
                f"{plan}: the build stage recorded this engine but it is missing (run `pipeline build`)"
            )
    return engines


def inside(run: RunDir, rel: str) -> Path:
    """`rel` (a path the manifest records) in the run directory; a PipelineError when it leads outside."""
    path = run.path / rel
    if not path.resolve().is_relative_to(run.path.resolve()):
        raise PipelineError(f"{run.path / MANIFEST}: build output {rel!r} is outside the run directory: refused")
    return path


def fleet_releases(run: RunDir, builds: DeviceBuilds | None = None) -> Releases:
    """The release for SSH devices: the run's files, the engine for each class (from the build stage, or from
    `builds` at install time for a class it has none for), and the activation script."""
    return Releases(run, recorded_engines(run), {ACTIVATE: ACTIVATE_SCRIPT}, builds)


def local_release(run: RunDir) -> HostRelease:
    """The release for local targets: the run's files, this host's engine if the build stage made one, and the
    activation script."""
    engine = local_engine(run)
    engine_class = engine and str(engine_info(engine[1])["class"])
    return HostRelease(make_release(run, engine, engine_class, {ACTIVATE: ACTIVATE_SCRIPT}))


def _body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    if cfg.deploy.inventory is not None:
        return _fleet_body(cfg, run, log)
    offer = local_release(run)
    engine_note = "with engine" if PLAN in offer.release.plan.files else "ONNX only"
    log(f"[deploy] release {offer.id} ({offer.release.plan.bytes / 1e6:.2f} MB, {engine_note})")
    rows = asyncio.run(_deploy_local(cfg, offer, log))
    write_json(run.path / DEPLOY_RESULTS, {"release": offer.id, "targets": [r.to_dict() for r in rows]})
    return _outcome(offer.id, rows, log)


async def _deploy_local(cfg: Config, offer: HostRelease, log: Callable[[str], None]) -> list[TargetResult]:
    """One local target after the other (they share this machine's disk and CPU)."""
    policy = Policy(keep_releases=cfg.deploy.keep_releases)
    hosts = [LocalHost(local_spot(t, cfg.deploy), policy.timeout_s) for t in cfg.deploy.targets]
    return [await remote.deploy(host, offer, policy, log) for host in hosts]


def _fleet_body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    assert cfg.deploy.inventory is not None
    inventory = load_inventory(cfg.deploy.inventory)
    builds = DeviceBuilds(cfg, run, inventory, log)
    releases = fleet_releases(run, builds)
    for key, variant in releases.variants.items():
        what = "ONNX only" if variant.engine_class is None else f"engine for {key}"
        log(f"[deploy] release {variant.id} ({variant.plan.bytes / 1e6:.2f} MB, {what})")
    log(f"[deploy] to {len(inventory.targets)} device(s); a class without an engine is built on its first device")
    waves_plan = {"waves": [[t.name for t in wave] for wave in waves(inventory)]}
    write_json(run.path / DEPLOY_PLAN, {**releases.summary(), **waves_plan})
    rows = asyncio.run(rollout(inventory, releases, log))
    write_json(run.path / DEPLOY_PLAN, {**releases.summary(), **waves_plan})  # with the install-time variants
    release = deployed(rows)
    targets = [r.to_dict() for r in rows]
    write_json(run.path / DEPLOY_RESULTS, {"release": release, "inventory": str(inventory.path), "targets": targets})
    # Engines this deploy put into the run (built on a device, or found in a cache) are its outputs too.
    placed = {
        key: str(path.relative_to(run.path))
        for klass, files in builds.placed.items()
        for key, path in zip(engine_keys(klass), files, strict=True)
    }
    return _outcome(release, rows, log, placed)


def deployed(rows: list[TargetResult]) -> str:
    """The release id the targets were offered, or the ids comma-separated when device classes got different ones."""
    return ", ".join(sorted({r.release for r in rows if r.release}))


def _outcome(
    release: str, rows: list[TargetResult], log: Callable[[str], None], outputs: dict[str, str] | None = None
) -> StageResult:
    """The stage's result when every target is ACTIVE (with `outputs` besides its files); otherwise the error naming
    each target that is not."""
    log(results_table(rows))
    bad = [r for r in rows if r.status != ACTIVE]
    if bad:
        detail = "; ".join(f"{r.target} ({r.status}: {r.reason})" for r in bad if r.failed)
        skipped = sum(1 for r in bad if not r.failed)
        more = f"; {skipped} skipped" if skipped else ""
        message = f"deploy: {len(bad)} of {len(rows)} targets not active: {detail or 'none failed'}{more}"
        # Only a lost link may go better on a retry (unreachable, or dropped mid-upload: the next try resumes from
        # what arrived; a disk that is still full is then refused by the space check); a refusal or a failed check
        # will fail the same way.
        tried = [r for r in bad if r.failed]
        transient = bool(tried) and all(r.status in (UNREACHABLE, UPLOAD_FAILED) for r in tried)
        raise (TransientError if transient else PipelineError)(message)
    metrics = {
        "release": release,
        "active": len(rows),
        "targets": len(rows),
        "bytes_sent": sum(r.bytes_sent for r in rows),
        "built_on_device": sum(r.built_on_device for r in rows),
    }
    return StageResult("deploy", "done", outputs={**STAGE.outputs, **(outputs or {})}, metrics=metrics)


STAGE = Stage(  # build and export: install-time builds use the class's builder options and the shapes
    name="deploy",
    sections=("deploy", "build", "export"),
    inputs=(ONNX, SAMPLE, MODEL_JSON),
    outputs={"results": DEPLOY_RESULTS, "plan": DEPLOY_PLAN},
    run=run,
)
