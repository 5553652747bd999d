"""Install-time engine builds: a device whose class has no engine in the run builds one with its own trtexec.

A device with TensorRT whose class the build stage made no engine for (declared `builder = "device"` without a
target, or a class nobody declared) gets its class's engine from, in this order:

1. the run's `engines/<class>/`, when an earlier deploy put it there for the same engine cache key;
2. the engine cache (`build.cache_dir`), keyed as the build stage keys it;
3. the device's own small cache, `<root>/engine-cache/<key>/` (what it built for an earlier deploy);
4. a build on the device: the build stage's job (pipeline.trt.engine_job) over SSH, in a private `mktemp -d`
   directory, with the class's flags and workspace for the device's TensorRT version, under the device's `timeout`,
   then verified there: plan version, a load, the outputs on the stored sample.

What the device had or built is its word alone: it comes back to the run's `engines/<class>/` and the engine cache, so
the class's other devices get it by upload, only once a second device of the class verified it (pipeline.trt.peer:
the bytes the controller fetched, loaded and checked there by that device's trtexec). Rejected by that device, it is
BUILD_FAILED on the builder and goes nowhere. With no other device of the class to ask, the builder alone runs it:
it lies in the run's `deploy/unverified/<device>/`, in no cache, and its build.json says "unverified by a peer". The
device keeps a copy in its cache, which the release's upload links instead of sending. Only then does the release with
that engine go through the usual upload, preflight and switch. A failed build is BUILD_FAILED: nothing on the device
changed, trtexec's failing line is the reason and its log stays in the run.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import asyncssh

from pipeline.config import BuildClass, Config
from pipeline.deploy.result import BUILD_FAILED, REFUSED, Stop, TargetResult
from pipeline.errors import PipelineError
from pipeline.files import sha256_file, write_json
from pipeline.fleet.classes import DeviceClass, from_facts
from pipeline.fleet.inventory import Inventory
from pipeline.fleet.probe import Facts
from pipeline.fleet.ssh import Completed, Device
from pipeline.layout import BUILD_INFO, DEPLOY_DIR, DEVICE_CACHE, ONNX, PLAN, SAMPLE, engine_dir
from pipeline.manifest import RunDir
from pipeline.trt import cache, engine_job, flags, publish
from pipeline.trt.engine_job import Job
from pipeline.trt.flags import Options
from pipeline.trt.peer import UNVERIFIED, Peers, shared, vouched
from pipeline.trt.profile import Profile, input_profile
from pipeline.trt.runners import Remote

UNVERIFIED_DIR = f"{DEPLOY_DIR}/unverified"
"""Where an engine no peer verified lies, per device that built it: `<run>/deploy/unverified/<device>/`."""


@dataclass
class DeviceBuilds:
    """Engines for the classes the run has none for, found or built per device (one class at a time: the caller
    holds a lock per class, so the first device of a class builds and the others find its engine)."""

    cfg: Config
    run: RunDir
    inventory: Inventory
    """The fleet: its keep_releases is what a device's engine cache keeps, its devices verify each other's engines."""
    log: Callable[[str], None] = print
    placed: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    """Class → (model.plan, build.json) put into the run's engines/ by this deploy."""

    @cached_property
    def peers(self) -> Peers:
        """The fleet's devices as verifiers of an engine one of them built (probed once, when first needed)."""
        policy = self.inventory.policy
        return Peers(self.inventory.targets, self.cfg.build.timeout_s, policy.max_parallel, self.log)

    @cached_property
    def profile(self) -> Profile:
        """The optimization profile, as the build stage makes it."""
        return input_profile(self.run.path / ONNX, self.cfg.export)

    @property
    def time_s(self) -> int:
        """Time a target may spend on its class's engine: its own build, its verification and a peer's (each trtexec
        run has build.timeout_s), or waiting for another device's."""
        return 3 * self.cfg.build.timeout_s

    def build_class(self, facts: Facts, target: str) -> BuildClass:
        """The device's class as declared in build.classes (its builder options), else as probed; built on `target`."""
        probed = from_facts(facts, target)
        declared = next((k for k in self.cfg.build.classes if k.name == probed.name), None)
        if declared is None:
            return probed
        return declared.model_copy(update={"target": target, "sm": declared.sm or probed.sm, "l4t": probed.l4t})

    async def engine(self, device: Device, facts: Facts, row: TargetResult) -> tuple[Path, Path]:
        """(model.plan, build.json) in the run for the device's class: found, or built on `device`; an engine no peer
        verified is the device's alone (its build.json says so). Stop(REFUSED) when the class cannot be built for
        this version (a missing ONNX variant, no DLA, facts naming no class), Stop(BUILD_FAILED) when the build, its
        verification or a peer's failed."""
        try:
            klass = self.build_class(facts, device.target.name)
        except PipelineError as err:
            raise Stop(REFUSED, str(err)) from None
        options = flags.options_for(self.cfg.build, klass)
        try:
            flags.plan(facts.tensorrt, options, self.run.path, facts.jetpack)
        except PipelineError as err:
            raise Stop(REFUSED, f"{klass.name}: {err}") from None
        key = cache.engine_key(cache.key_parts(self.run.path, klass.name, facts.tensorrt, options, self.profile))
        dest = self.run.path / engine_dir(klass.name)
        verified = self.cfg.build.verify
        if _in_run(dest, key) or publish.from_cache(self.cfg.build.cache_dir, klass.name, key, dest, verified):
            self.placed[klass.name] = (dest / PLAN, dest / BUILD_INFO)
            return self.placed[klass.name]
        return await self._on_device(device, klass, options, facts, key, row)

    async def _on_device(
        self, device: Device, klass: BuildClass, options: Options, facts: Facts, key: str, row: TargetResult
    ) -> tuple[Path, Path]:
        """The engine from the device's cache, else built there; then a peer's verdict decides where it goes."""
        name, build_cfg, run_path = device.target.name, self.cfg.build, self.run.path
        failed_log = run_path / DEPLOY_DIR / "build-failed" / f"{name}.log"
        runner = Remote(device, klass.device_trtexec)
        try:
            await runner.open()
            with publish.staging(run_path / DEPLOY_DIR / f".staging-{name}", failed_log) as staging:
                version, jetpack = facts.tensorrt, facts.jetpack
                job = engine_job.new_job(
                    build_cfg, run_path, staging, self.profile, klass.name, version, options, jetpack
                )
                info, status = await self._from_device_cache(runner, key, klass, staging), "device"
                if info is None:
                    info, status = await self._build(runner, klass, job, row), "miss"
                    await self._keep_on_device(runner, key, staging)
                return await self._second_opinion(name, klass, facts, job, info, status)
        except PipelineError as err:
            raise Stop(BUILD_FAILED, str(err)) from None
        finally:
            await runner.close()

    async def _build(self, runner: Remote, klass: BuildClass, job: Job, row: TargetResult) -> dict[str, Any]:
        """Build and verify on the device; build.json (in the staging directory too, for the device's cache)."""
        self.log(f"[deploy] {runner.device.target.name}: building {klass.name} (TensorRT {job.version}) on the device")
        built, checks, seconds = await engine_job.build_and_verify(
            runner, job, self.cfg.build.verify, self.run.path / SAMPLE
        )
        row.built_on_device, row.build_seconds = True, round(seconds, 3)
        info = engine_job.build_info(job, klass, built, checks, seconds)
        write_json(job.staging / BUILD_INFO, info)
        return info

    async def _from_device_cache(
        self, runner: Remote, key: str, klass: BuildClass, staging: Path
    ) -> dict[str, Any] | None:
        """The device's cached engine for `key` fetched into the staging directory, and its build.json as this
        controller takes it (the device's word on who built or verified it counts for nothing); None when it has
        none, or one that does not match its build.json or class, or is unverified while build.verify asks for
        verification."""
        name = runner.device.target.name
        entry = shlex.quote(f"{runner.device.target.root}/{DEVICE_CACHE}/{key}")
        out = await runner.device.run(f"cp {entry}/{PLAN} {entry}/{BUILD_INFO} {shlex.quote(runner.workdir)}/")
        fetched = (
            out.ok and await runner.get(PLAN, staging / PLAN) and await runner.get(BUILD_INFO, staging / BUILD_INFO)
        )
        if not fetched:
            return None
        info = publish.read_info(staging)
        if info.get("cache_key") != key or info.get("engine_sha256") != sha256_file(staging / PLAN):
            return None
        if info.get("class") != klass.name or (self.cfg.build.verify and not info.get("verification", {}).get("loads")):
            return None
        self.log(f"[deploy] {name}: engine {key} from the device's cache")
        return {**info, "built_by": name, "verified_by": None, "peer_check": None}

    async def _second_opinion(
        self, builder: str, klass: BuildClass, facts: Facts, job: Job, info: dict[str, Any], status: str
    ) -> tuple[Path, Path]:
        """Publish the engine in the staging directory once a second device of the class verified it; without one,
        keep it for `builder` alone. A peer's rejection is a PipelineError naming both devices."""
        sample = self.run.path / SAMPLE
        verdict = await self.peers.verify(DeviceClass.probed(facts), builder, klass.device_trtexec, job, sample)
        info = vouched(info, verdict)
        if verdict is None:
            self.log(
                f"[deploy] {builder}: {klass.name} engine {UNVERIFIED} (no other device of the class answered): "
                f"{builder} alone runs it, it is not cached nor sent to other devices"
            )
            dest = self.run.path / UNVERIFIED_DIR / builder
            publish.publish_engine(job.staging, info, None, dest, status)
            return dest / PLAN, dest / BUILD_INFO
        self.log(f"[deploy] {builder}: {klass.name} engine verified on {verdict[0]}, another device of the class")
        dest = self.run.path / engine_dir(klass.name)
        publish.publish_engine(job.staging, info, self.cfg.build.cache_dir, dest, status)
        self.placed[klass.name] = (dest / PLAN, dest / BUILD_INFO)
        return self.placed[klass.name]

    async def _keep_on_device(self, runner: Remote, key: str, staging: Path) -> None:
        """Keep the engine just built in the device's cache (on its disk before the entry is renamed into place),
        and only the fleet's keep_releases newest entries. A full disk leaves the cache as it was: it only saves a
        rebuild."""
        device = runner.device
        cache_dir = f"{device.target.root}/{DEVICE_CACHE}"
        tmp, entry = shlex.quote(f"{cache_dir}/.{key}.tmp"), shlex.quote(f"{cache_dir}/{key}")
        keep = self.inventory.policy.keep_releases
        prune = f'ls -1t | tail -n +{keep + 1} | while read -r old; do rm -rf -- "$old"; done'
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
    """Whether `dest` holds the engine for `key` whole (an earlier deploy of this run put it there), one that may go
    to any device of its class."""
    if not (dest / BUILD_INFO).is_file() or not (dest / PLAN).is_file():
        return False
    info = publish.read_info(dest)
    return info.get("cache_key") == key and info.get("engine_sha256") == sha256_file(dest / PLAN) and shared(info)
