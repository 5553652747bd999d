"""The one build path: an engine per device class, from the engine cache when its key matches, else built by the
class's builder (the Python API or trtexec here, trtexec on a device over SSH), verified where it was built, and
published to `engines/<class>/` with its build.json (one set of fields for every class). An engine built on a device
goes into the engine cache, and to the class's other devices, only once a second device of the class verified it
(pipeline.trt.peer); without one it is that device's alone.

This host is a device class too (`build_host`): its class, `local-<sm>-trt<version>`, is built by its own builder
with a local runner, like a declared class with builder "python" or "trtexec". trtexec reports the GPU only while
building, so a host class not yet named before the build (`local`) is published under the name the build gives it.

A failed build keeps trtexec's log as `engines/<class>/build-failed.log` (the class as named when the build started)
and its error says "(full log: PATH)"; the next successful build of that class removes it. A declared class that
cannot be built here is reported "not built" with the reason; deploy builds such a class (and any class it finds
without an engine) on its first device at install time, through the same job (pipeline.deploy.device_build).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import BuildClass, Config
from pipeline.engines import python_api
from pipeline.engines.detect import Choice, Host, probe_host
from pipeline.errors import PipelineError, TransientError
from pipeline.files import first_line
from pipeline.fleet.classes import DeviceClass, checked
from pipeline.fleet.inventory import Inventory, SshTarget, load_inventory
from pipeline.fleet.probe import Facts, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Device, Refused
from pipeline.host import python_api_problem
from pipeline.layout import BUILD_INFO, ENGINES, PLAN, SAMPLE, engine_dir
from pipeline.manifest import RunDir
from pipeline.trt import cache, engine_job, publish
from pipeline.trt.built import Built
from pipeline.trt.engine_job import Job
from pipeline.trt.flags import Options, options_for
from pipeline.trt.peer import UNVERIFIED, Peers, shared, vouched
from pipeline.trt.profile import Profile
from pipeline.trt.runners import Local, Remote, Runner
from pipeline.trt.verify import same_version

NOT_BUILT = "not built"
FAILED_LOG = "build-failed.log"


class NotBuilt(Exception):
    """This host cannot build the class: the message is the reason shown in the manifest."""


@dataclass(frozen=True)
class Context:
    """Everything one class build needs from the stage."""

    cfg: Config
    run: RunDir
    profile: Profile
    log: Callable[[str], None]

    @property
    def engines(self) -> Path:
        """engines/ of the run."""
        return self.run.path / ENGINES


def build_class(ctx: Context, klass: BuildClass) -> dict[str, Any]:
    """Bring `engines/<class>/` up to date; returns the class's row for metrics and engines/classes.json."""
    row: dict[str, Any] = {"class": klass.name, "builder": klass.builder, "cache": None, "reason": ""}
    try:
        return {**row, **_build_or_reuse(ctx, klass)}
    except NotBuilt as why:
        ctx.log(f"[build] {klass.name}: not built: {why}")
        return {**row, "status": NOT_BUILT, "reason": str(why)}


def build_host(ctx: Context, host: Host) -> dict[str, Any]:
    """Bring this host's class up to date with its own builder (a failure is a PipelineError); returns its row."""
    return _here(ctx, host.as_class(ctx.engines), host.tensorrt_version or "", host.choice.trtexec, named_by_build=True)


def _build_or_reuse(ctx: Context, klass: BuildClass) -> dict[str, Any]:
    if klass.builder == "device":
        if not klass.target:
            raise NotBuilt("builder 'device' without a build target: the device builds it at install time")
        return asyncio.run(_on_device(ctx, klass, *_fleet(ctx.cfg, klass)))
    host = probe_host(_choice(klass))
    version = _check_match(klass, host.tensorrt_version, host.sm, f"this host ({klass.builder})")
    return _here(ctx, klass, version, host.choice.trtexec)


def _choice(klass: BuildClass) -> Choice:
    """The class's builder on this host; NotBuilt when this host lacks it."""
    if klass.builder == "python":
        problem = python_api_problem()
        if problem is not None:
            raise NotBuilt(f"builder 'python': {problem}")
        return Choice("python")
    exe = shutil.which(klass.trtexec)
    if exe is None:
        raise NotBuilt(f"builder 'trtexec': {klass.trtexec!r} is not an executable on PATH here")
    return Choice("trtexec", trtexec=exe)


def _check_match(klass: BuildClass, version: str | None, sm: str | None, where: str) -> str:
    """The TensorRT version to build with; NotBuilt when the builder's TensorRT or GPU is not the class's."""
    if version is not None and not same_version(version, klass.tensorrt):
        raise NotBuilt(f"{where} has TensorRT {version}, the class needs {klass.tensorrt}")
    if klass.sm and sm and sm != klass.sm:
        raise NotBuilt(f"{where} has a {sm} GPU, the class needs {klass.sm}")
    return version or klass.tensorrt


def _here(
    ctx: Context, klass: BuildClass, version: str, exe: str | None, named_by_build: bool = False
) -> dict[str, Any]:
    """Build with trtexec `exe` here, or the Python API when `exe` is None; `version` is the builder's TensorRT."""
    options = options_for(ctx.cfg.build, klass)
    hit = _reuse(ctx, klass, version, options)
    if hit is not None:
        return hit
    with _staging(ctx, klass) as workdir:
        job = engine_job.new_job(ctx.cfg.build, ctx.run.path, workdir, ctx.profile, klass.name, version, options)
        ctx.log(f"[build] {klass.name}: building on this host with {klass.builder} (TensorRT {version or '?'})")
        if exe is not None:
            built, checks, seconds = asyncio.run(_verified(ctx, Local(exe, workdir), job))
        else:
            started = time.perf_counter()
            built = python_api.build(ctx.run.path, workdir, ctx.profile, options, ctx.log)
            seconds = time.perf_counter() - started
            checks = asyncio.run(_verify_python_api(ctx, job))
        if named_by_build:
            klass = _named_by(klass, built)
        return _publish(ctx, klass, job, engine_job.build_info(job, klass, built, checks, seconds))


async def _verified(ctx: Context, runner: Runner, job: Job) -> tuple[Built, dict[str, Any], float]:
    return await engine_job.build_and_verify(runner, job, ctx.cfg.build.verify, ctx.run.path / SAMPLE)


async def _verify_python_api(ctx: Context, job: Job) -> dict[str, Any]:
    """The Python API does not run engines the way trtexec does: build.trtexec verifies it when this host has one."""
    verifier = shutil.which(ctx.cfg.build.trtexec)
    if not ctx.cfg.build.verify:
        return {"checked": False, "reason": "build.verify = false"}
    if verifier is None:
        return {"checked": False, "reason": f"no trtexec here ({ctx.cfg.build.trtexec!r}) to verify with"}
    sample = ctx.run.path / SAMPLE
    return await engine_job.check(Local(verifier, job.staging), job, sample if sample.is_file() else None)


def _named_by(klass: BuildClass, built: Built) -> BuildClass:
    """This host's class as its build reports it (trtexec prints the GPU and TensorRT version it built with)."""
    sm = built.sm or klass.sm
    name = str(DeviceClass.this_host(sm, built.tensorrt_version or klass.tensorrt))
    return klass.model_copy(update={"name": name, "sm": sm or ""})


async def _on_device(ctx: Context, klass: BuildClass, target: SshTarget, fleet: Inventory) -> dict[str, Any]:
    """Build on `target`, then let another device of its class in `fleet` verify the engine (pipeline.trt.peer)."""
    options = options_for(ctx.cfg.build, klass)
    try:
        async with Device(target, command_timeout_s=ctx.cfg.build.timeout_s) as device:
            facts = parse_facts((await device.run(probe_script(target.root), timeout_s=30)).stdout)
            probed = _probed(facts, target.name)
            version = _check_match(klass, facts.tensorrt or None, probed.sm or None, f"device {target.name}")
            hit = _reuse(ctx, klass, version, options)
            if hit is not None:
                return hit
            with _staging(ctx, klass) as workdir:
                build_cfg, run_path, profile = ctx.cfg.build, ctx.run.path, ctx.profile
                job = engine_job.new_job(
                    build_cfg, run_path, workdir, profile, klass.name, version, options, facts.jetpack
                )
                runner = Remote(device, klass.device_trtexec)
                await runner.open()
                try:
                    ctx.log(f"[build] {klass.name}: building on {target.name} (TensorRT {version})")
                    built, checks, seconds = await _verified(ctx, runner, job)
                finally:
                    await runner.close()
                info = engine_job.build_info(job, klass, built, checks, seconds)
                peers = Peers(fleet.targets, build_cfg.timeout_s, fleet.policy.max_parallel, ctx.log)
                verdict = await peers.verify(probed, target.name, klass.device_trtexec, job, run_path / SAMPLE)
                return _publish(ctx, klass, job, vouched(info, verdict))
    except Refused as err:
        raise NotBuilt(f"device {target.name} refused: {err}") from None
    except FAILURES as err:
        # Unreachable now may be reachable on the next try: the flow retries TransientError, and only that.
        why = first_line(err, typed=True)
        raise TransientError(f"build device {target.name} unreachable: {why}") from None


def _probed(facts: Facts, target: str) -> DeviceClass:
    """The build device's class as probed; NotBuilt when what it reports names none."""
    try:
        return checked(facts, target)
    except PipelineError as err:
        raise NotBuilt(str(err)) from None


def _fleet(cfg: Config, klass: BuildClass) -> tuple[SshTarget, Inventory]:
    """The class's build target and the inventory (its peers among the devices)."""
    if cfg.deploy.inventory is None:
        raise PipelineError(f"build.classes: {klass.name}: target {klass.target!r} needs deploy.inventory")
    inventory = load_inventory(cfg.deploy.inventory)
    for target in inventory.targets:
        if target.name == klass.target:
            return target, inventory
    raise PipelineError(f"build.classes: {klass.name}: target {klass.target!r} is not in {cfg.deploy.inventory}")


def _reuse(ctx: Context, klass: BuildClass, version: str, options: Options) -> dict[str, Any] | None:
    """Copy the cached engine in when the key matches (and it is verified, when build.verify asks); None on a miss."""
    key = cache.engine_key(cache.key_parts(ctx.run.path, klass.name, version, options, ctx.profile))
    info = publish.from_cache(ctx.cfg.build.cache_dir, klass.name, key, ctx.engines / klass.name, ctx.cfg.build.verify)
    if info is None:
        return None
    ctx.log(f"[build] {klass.name}: engine cache hit ({key})")
    return _row(info, "cached")


def _staging(ctx: Context, klass: BuildClass) -> contextlib.AbstractContextManager[Path]:
    """A fresh staging directory for one class; a failed build's trtexec log is kept as
    `engines/<class>/build-failed.log` (the class as named when the build started)."""
    path = ctx.engines / f".staging-{os.getpid()}-{klass.name}"
    return publish.staging(path, ctx.engines / klass.name / FAILED_LOG)


def _publish(ctx: Context, klass: BuildClass, job: Job, info: dict[str, Any]) -> dict[str, Any]:
    """Move the verified engine into engines/<class>/ (build.json last), and into the engine cache unless a device
    built it and no second device verified it (then only that device gets it: pipeline.trt.peer)."""
    dest = ctx.engines / klass.name
    cache_dir = ctx.cfg.build.cache_dir if shared(info) else None
    info = publish.publish_engine(job.staging, info, cache_dir, dest)
    ctx.log(f"[build] {klass.name}: built ({(dest / PLAN).stat().st_size / 1e6:.2f} MB), cache miss{_vouched_by(info)}")
    return _row(info, "built")


def _vouched_by(info: dict[str, Any]) -> str:
    """What the build line says of the engine's verifier."""
    if shared(info):
        return f", verified by {info['verified_by']}" if info.get("verified_by") else ""
    return f", {UNVERIFIED}: only {info['built_by']} gets it, it is not cached"


def _row(info: dict[str, Any], status: str) -> dict[str, Any]:
    klass = info["class"]
    return {
        "class": klass,
        "builder": info["builder"],
        "status": status,
        "cache": info["cache"],
        "tensorrt_version": info["tensorrt_version"],
        "engine": f"{engine_dir(klass)}/{PLAN}",
        "build_info": f"{engine_dir(klass)}/{BUILD_INFO}",
        "verified": bool(info.get("verification", {}).get("loads")),
        "built_by": info.get("built_by"),
        "verified_by": info.get("verified_by"),
        "latency": info.get("latency", {}),
        "seconds": info.get("seconds"),
    }
