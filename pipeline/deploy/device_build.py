"""Install-time engine builds: a device whose class has no engine in the run builds one with its own trtexec.

A device with TensorRT whose class the build stage made no engine for (declared `builder = "device"` without a
target, or a class nobody declared) gets its class's engine from, in this order:

1. the run's `engines/<class>/`, when an earlier deploy put it there for the same engine cache key;
2. the engine cache (`build.cache_dir`), keyed as the build stage keys it;
3. the device's own small cache, `<root>/engine-cache/<key>/` (what it built for an earlier deploy);
4. a build on the device: the build stage's job (pipeline.trt.engine_job) over SSH, in a private `mktemp -d`
   directory, with the class's flags and workspace for the device's TensorRT version, under the device's `timeout`,
   then verified there: plan version, a load, the outputs on the stored sample.

Whatever the device had or built comes back to the run's `engines/<class>/` and the engine cache, so the class's other
devices get it by upload; the device keeps a copy in its cache, which the release's upload links instead of sending.
Only then does the release with that engine go through the usual upload, preflight and switch. A failed build is
BUILD_FAILED: nothing on the device changed, trtexec's failing line is the reason and its log stays in the run.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import asyncssh

from pipeline.config import BuildClass, Config
from pipeline.deploy.result import BUILD_FAILED, REFUSED, Stop, TargetResult
from pipeline.errors import PipelineError
from pipeline.files import sha256_file
from pipeline.fleet.classes import DeviceClass, from_facts
from pipeline.fleet.probe import Facts
from pipeline.fleet.ssh import Completed, Device
from pipeline.layout import BUILD_INFO, DEPLOY_DIR, DEVICE_CACHE, ONNX, PLAN, SAMPLE, engine_dir
from pipeline.manifest import RunDir
from pipeline.trt import cache, engine_job, flags, publish
from pipeline.trt.flags import Options
from pipeline.trt.profile import Profile, input_profile
from pipeline.trt.runners import Remote


@dataclass
class DeviceBuilds:
    """Engines for the classes the run has none for, found or built per device (one class at a time: the caller
    holds a lock per class, so the first device of a class builds and the others find its engine)."""

    cfg: Config
    run: RunDir
    keep: int
    """Entries a device's engine cache keeps (the fleet's keep_releases)."""
    log: Callable[[str], None] = print
    placed: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    """Class → (model.plan, build.json) put into the run's engines/ by this deploy."""

    @cached_property
    def profile(self) -> Profile:
        """The optimization profile, as the build stage makes it."""
        return input_profile(self.run.path / ONNX, self.cfg.export)

    @property
    def time_s(self) -> int:
        """Time a target may spend on its class's engine: its own build and verification (each trtexec run has
        build.timeout_s), or waiting for another device's."""
        return 3 * self.cfg.build.timeout_s

    def build_class(self, facts: Facts, target: str) -> BuildClass:
        """The device's class as declared in build.classes (its builder options), else as probed; built on `target`."""
        probed = from_facts(facts, target)
        declared = next((k for k in self.cfg.build.classes if k.name == probed.name), None)
        if declared is None:
            return probed
        return declared.model_copy(update={"target": target, "sm": declared.sm or probed.sm, "l4t": probed.l4t})

    async def engine(self, device: Device, facts: Facts, row: TargetResult) -> tuple[Path, Path]:
        """(model.plan, build.json) in the run for the device's class: found, or built on `device`. Stop(REFUSED)
        when the class cannot be built for this version (a missing ONNX variant, no DLA), Stop(BUILD_FAILED) when
        the build or its verification failed."""
        try:
            klass = self.build_class(facts, device.target.name)
        except ValueError:  # pydantic's: what the device reported is no TensorRT version (or class name)
            why = f"the probe found TensorRT {facts.tensorrt!r}, not a version an engine can be built for"
            raise Stop(REFUSED, f"{DeviceClass.probed(facts)}: {why}") from None
        options = flags.options_for(self.cfg.build, klass)
        try:
            flags.plan(facts.tensorrt, options, self.run.path, facts.jetpack)
        except PipelineError as err:
            raise Stop(REFUSED, f"{klass.name}: {err}") from None
        key = cache.engine_key(cache.key_parts(self.run.path, klass.name, facts.tensorrt, options, self.profile))
        dest = self.run.path / engine_dir(klass.name)
        verified = self.cfg.build.verify
        if not (_in_run(dest, key) or publish.from_cache(self.cfg.build.cache_dir, klass.name, key, dest, verified)):
            await self._on_device(device, klass, options, facts, key, row)
        self.placed[klass.name] = (dest / PLAN, dest / BUILD_INFO)
        return self.placed[klass.name]

    async def _on_device(
        self, device: Device, klass: BuildClass, options: Options, facts: Facts, key: str, row: TargetResult
    ) -> None:
        """The engine from the device's cache, else built there; either way into the run and the engine cache."""
        name, build_cfg, run_path = device.target.name, self.cfg.build, self.run.path
        failed_log = run_path / DEPLOY_DIR / "build-failed" / f"{name}.log"
        runner = Remote(device, klass.device_trtexec)
        await runner.open()
        try:
            with publish.staging(run_path / DEPLOY_DIR / f".staging-{name}", failed_log) as staging:
                if not await self._from_device_cache(runner, key, staging, run_path / engine_dir(klass.name)):
                    version, jetpack = facts.tensorrt, facts.jetpack
                    job = engine_job.new_job(
                        build_cfg, run_path, staging, self.profile, klass.name, version, options, jetpack
                    )
                    await self._build(runner, klass, job, row)
                    await self._keep_on_device(runner, key, staging)
        except PipelineError as err:
            raise Stop(BUILD_FAILED, str(err)) from None
        finally:
            await runner.close()

    async def _build(self, runner: Remote, klass: BuildClass, job: engine_job.Job, row: TargetResult) -> None:
        self.log(f"[deploy] {runner.device.target.name}: building {klass.name} (TensorRT {job.version}) on the device")
        built, checks, seconds = await engine_job.build_and_verify(
            runner, job, self.cfg.build.verify, self.run.path / SAMPLE
        )
        info = engine_job.build_info(job, klass, built, checks, seconds)
        publish.publish_engine(job.staging, info, self.cfg.build.cache_dir, self.run.path / engine_dir(klass.name))
        row.built_on_device, row.build_seconds = True, round(seconds, 3)

    async def _from_device_cache(self, runner: Remote, key: str, staging: Path, dest: Path) -> bool:
        """Fetch the device's cached engine for `key` into `dest` and the engine cache; False when it has none (or
        one that does not match its build.json, or is unverified while build.verify asks for verification)."""
        entry = shlex.quote(f"{runner.device.target.root}/{DEVICE_CACHE}/{key}")
        out = await runner.device.run(f"cp {entry}/{PLAN} {entry}/{BUILD_INFO} {shlex.quote(runner.workdir)}/")
        fetched = (
            out.ok and await runner.get(PLAN, staging / PLAN) and await runner.get(BUILD_INFO, staging / BUILD_INFO)
        )
        if not fetched:
            return False
        info = publish.read_info(staging)
        if info.get("cache_key") != key or info.get("engine_sha256") != sha256_file(staging / PLAN):
            return False
        if self.cfg.build.verify and not info.get("verification", {}).get("loads"):
            return False
        publish.publish_engine(staging, info, self.cfg.build.cache_dir, dest, status="device")
        self.log(f"[deploy] {runner.device.target.name}: engine {key} from the device's cache")
        return True

    async def _keep_on_device(self, runner: Remote, key: str, staging: Path) -> None:
        """Keep the engine just built in the device's cache (on its disk before the entry is renamed into place),
        and only the `keep` newest entries. A full disk leaves the cache as it was: it only saves a rebuild."""
        device = runner.device
        cache_dir = f"{device.target.root}/{DEVICE_CACHE}"
        tmp, entry = shlex.quote(f"{cache_dir}/.{key}.tmp"), shlex.quote(f"{cache_dir}/{key}")
        prune = f'ls -1t | tail -n +{self.keep + 1} | while read -r old; do rm -rf -- "$old"; done'
        try:
            done = await device.run(f"rm -rf {tmp} && mkdir -p {tmp} && cp {shlex.quote(runner.path(PLAN))} {tmp}/")
            if done.ok:
                await device.put(staging / BUILD_INFO, f"{cache_dir}/.{key}.tmp/{BUILD_INFO}")
                done = await device.run(
                    f"{{ sync -- {tmp} {tmp}/* 2>/dev/null || sync; }} && rm -rf {entry} && mv {tmp} {entry} && "
                    f"cd {shlex.quote(cache_dir)} && {prune}"
                )
        except asyncssh.SFTPError as err:  # no "disk full" code over SFTP (docs/ssh-and-devices.md)
            done = Completed(1, "", str(err))
        if not done.ok:
            await device.run(f"rm -rf {tmp}")
            self.log(f"[deploy] {device.target.name}: engine not kept in the device's cache: {done.tail()}")


def _in_run(dest: Path, key: str) -> bool:
    """Whether `dest` holds the engine for `key` whole (an earlier deploy of this run put it there)."""
    if not (dest / BUILD_INFO).is_file() or not (dest / PLAN).is_file():
        return False
    info = publish.read_info(dest)
    return info.get("cache_key") == key and info.get("engine_sha256") == sha256_file(dest / PLAN)
