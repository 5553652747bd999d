"""The one build path: an engine per device class, from the engine cache when its key matches, else built by the
class's builder (the Python API or trtexec here, trtexec on a device over SSH), verified where it was built, and
published to `engines/<class>/` with its build.json (one set of fields for every class).

This host is a device class too (`build_host`): its class, `local-<sm>-trt<version>`, is built by its own builder
with a local runner, like a declared class with builder "python" or "trtexec". trtexec reports the GPU only while
building, so a host class not yet named before the build (`local`) is published under the name the build gives it.

A failed build keeps trtexec's log as `engines/<class>/build-failed.log` (the class as named when the build started)
and its error says "(full log: PATH)"; the next successful build of that class removes it. A declared class that
cannot be built here is reported "not built" with the reason; the deploy contract for such a class is an
install-time build on the device (builder "device" without a build target).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import BuildClass, Config
from pipeline.engines import python_api
from pipeline.engines.detect import Choice, Host, probe_host
from pipeline.errors import PipelineError
from pipeline.files import atomic_path, publish, read_json, write_json
from pipeline.fleet.classes import device_class
from pipeline.fleet.inventory import SshTarget, load_inventory
from pipeline.fleet.probe import SOCS, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Device, HostKeyRefused
from pipeline.host import python_api_problem
from pipeline.layout import BUILD_INFO, ENGINES, PLAN, SAMPLE, engine_dir
from pipeline.manifest import RunDir
from pipeline.trt import cache, engine_job
from pipeline.trt.built import Built
from pipeline.trt.engine_job import Job
from pipeline.trt.flags import Options, options_for
from pipeline.trt.profile import Profile
from pipeline.trt.runners import Local, Remote
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
        return asyncio.run(_on_device(ctx, klass, _target(ctx.cfg, klass)))
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
        job = _job(ctx, klass, workdir, version, options)
        ctx.log(f"[build] {klass.name}: building on this host with {klass.builder} (TensorRT {version or '?'})")
        started = time.perf_counter()
        built, runner = _build_here(ctx, job, exe)
        seconds = time.perf_counter() - started
        checks = asyncio.run(_verify(ctx, runner, job))
        if named_by_build:
            klass = _named_by(klass, built)
        return _publish(ctx, klass, job, built, checks, seconds)


def _build_here(ctx: Context, job: Job, exe: str | None) -> tuple[Built, Local | None]:
    """The engine's facts and the runner that verifies it (None: no trtexec here to verify with)."""
    if exe is not None:
        runner = Local(exe, job.staging)
        return asyncio.run(engine_job.build(runner, job)), runner
    built = python_api.build(ctx.run.path, job.staging, ctx.profile, job.options, ctx.log)
    # The Python API does not run engines the way trtexec does: build.trtexec verifies it when this host has one.
    verifier = shutil.which(ctx.cfg.build.trtexec)
    return built, Local(verifier, job.staging) if verifier else None


def _named_by(klass: BuildClass, built: Built) -> BuildClass:
    """This host's class as its build reports it (trtexec prints the GPU and TensorRT version it built with)."""
    sm = built.sm or klass.sm
    name = device_class(sm, built.tensorrt_version or klass.tensorrt)
    return klass.model_copy(update={"name": name, "sm": sm or ""})


async def _on_device(ctx: Context, klass: BuildClass, target: SshTarget) -> dict[str, Any]:
    options = options_for(ctx.cfg.build, klass)
    try:
        async with Device(target, command_timeout_s=ctx.cfg.build.timeout_s) as device:
            facts = parse_facts((await device.run(probe_script(target.root), timeout_s=30)).stdout)
            sm = SOCS.get(facts.soc, ("", None))[1]
            version = _check_match(klass, facts.tensorrt or None, sm, f"device {target.name}")
            hit = _reuse(ctx, klass, version, options)
            if hit is not None:
                return hit
            with _staging(ctx, klass) as workdir:
                job = _job(ctx, klass, workdir, version, options, facts.jetpack)
                runner = Remote(device, klass.device_trtexec, f"/tmp/edge-build-{os.getpid()}-{klass.name}")
                await runner.open()
                try:
                    ctx.log(f"[build] {klass.name}: building on {target.name} (TensorRT {version})")
                    started = time.perf_counter()
                    built = await engine_job.build(runner, job)
                    seconds = time.perf_counter() - started
                    checks = await _verify(ctx, runner, job)
                finally:
                    await runner.close()
                return _publish(ctx, klass, job, built, checks, seconds)
    except (*FAILURES, HostKeyRefused) as err:
        raise NotBuilt(f"device {target.name} unreachable: {str(err).strip() or type(err).__name__}") from None


def _target(cfg: Config, klass: BuildClass) -> SshTarget:
    if cfg.deploy.inventory is None:
        raise PipelineError(f"build.classes: {klass.name}: target {klass.target!r} needs deploy.inventory")
    inventory = load_inventory(cfg.deploy.inventory)
    for target in inventory.targets:
        if target.name == klass.target:
            return target
    raise PipelineError(f"build.classes: {klass.name}: target {klass.target!r} is not in {cfg.deploy.inventory}")


def _job(ctx: Context, klass: BuildClass, workdir: Path, version: str, options: Options, jetpack: str = "") -> Job:
    seed = cache.timing_cache(ctx.cfg.build.cache_dir, klass.name)
    if seed.is_file():
        shutil.copyfile(seed, workdir / engine_job.CACHE)
    return Job(klass.name, ctx.run.path, workdir, ctx.profile, options, version, ctx.cfg.build.timeout_s, jetpack)


def _reuse(ctx: Context, klass: BuildClass, version: str, options: Options) -> dict[str, Any] | None:
    """Copy the cached engine in when the key matches; None on a miss."""
    key = cache.engine_key(cache.key_parts(ctx.run.path, klass.name, version, options, ctx.profile))
    entry = cache.lookup(ctx.cfg.build.cache_dir, klass.name, key)
    if entry is None:
        return None
    info = {**_read_info(entry), "cache": "hit"}
    if ctx.cfg.build.verify and not info.get("verification", {}).get("loads"):
        return None  # built with build.verify = false: rebuild so that it is verified
    dest = ctx.engines / klass.name
    dest.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest / PLAN) as tmp:
        shutil.copyfile(entry / PLAN, tmp)
    write_json(dest / BUILD_INFO, info)
    ctx.log(f"[build] {klass.name}: engine cache hit ({key})")
    return _row(info, "cached")


def _read_info(entry: Path) -> dict[str, Any]:
    info = read_json(entry / BUILD_INFO)
    if not isinstance(info, dict):
        raise PipelineError(f"{entry / BUILD_INFO}: not a JSON object (delete the entry)")
    return info


async def _verify(ctx: Context, runner: Local | Remote | None, job: Job) -> dict[str, Any]:
    """Verify where the engine was built; `runner` None: no trtexec here to verify with."""
    if not ctx.cfg.build.verify:
        return {"checked": False, "reason": "build.verify = false"}
    if runner is None:
        return {"checked": False, "reason": f"no trtexec here ({ctx.cfg.build.trtexec!r}) to verify with"}
    sample = ctx.run.path / SAMPLE
    return await engine_job.check(runner, job, sample if sample.is_file() else None)


@contextmanager
def _staging(ctx: Context, klass: BuildClass) -> Iterator[Path]:
    """A fresh staging directory for one class, removed afterwards. A build failing with a trtexec log keeps the
    log as `engines/<class>/build-failed.log` and raises the error again with that path; a success removes it."""
    path = ctx.engines / f".staging-{os.getpid()}-{klass.name}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    failed_log = ctx.engines / klass.name / FAILED_LOG
    try:
        yield path
    except PipelineError as err:
        log = path / engine_job.LOG
        if not log.is_file():
            raise
        failed_log.parent.mkdir(parents=True, exist_ok=True)
        os.replace(log, failed_log)
        raise PipelineError(f"{err} (full log: {failed_log})") from None
    else:
        failed_log.unlink(missing_ok=True)
        # Empty when it held nothing but that log: this host's `local`, before its build named the class.
        with contextlib.suppress(OSError):
            failed_log.parent.rmdir()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _publish(
    ctx: Context, klass: BuildClass, job: Job, built: Built, checks: dict[str, Any], seconds: float
) -> dict[str, Any]:
    """Store the verified engine in the engine cache and move it into engines/<class>/ (build.json last)."""
    info = engine_job.build_info(job, klass, built, checks, seconds)
    write_json(job.staging / BUILD_INFO, info)
    files = {PLAN: job.staging / PLAN, BUILD_INFO: job.staging / BUILD_INFO}
    cache.store(ctx.cfg.build.cache_dir, klass.name, info["cache_key"], files)
    cache.keep_timing_cache(job.staging / engine_job.CACHE, ctx.cfg.build.cache_dir, klass.name)
    dest = ctx.engines / klass.name
    dest.mkdir(parents=True, exist_ok=True)
    for src, name in ((PLAN, PLAN), (engine_job.CACHE, engine_job.CACHE), (engine_job.LOG, "build.log")):
        if (job.staging / src).is_file():
            publish(job.staging / src, dest / name)
    info["cache"] = "miss"
    write_json(dest / BUILD_INFO, info)
    ctx.log(f"[build] {klass.name}: built ({(dest / PLAN).stat().st_size / 1e6:.2f} MB), cache miss")
    return _row(info, "built")


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
        "latency": info.get("latency", {}),
        "seconds": info.get("seconds"),
    }
