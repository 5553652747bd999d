"""One engine for one device class with trtexec behind a runner (here or on a device): build, fetch, verify.

The steps are the same wherever trtexec runs, for the build stage and for deploy's install-time builds: place the ONNX
file (and the class's timing cache) in the runner's work directory and check its sha256 there, build under the time
limit, fetch the engine and check its sha256 against the runner's side, then verify it there: plan version, a load on
the export stage's sample, agreement with ONNX Runtime, latency.
"""

from __future__ import annotations

import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import BuildClass, BuildConfig
from pipeline.errors import PipelineError
from pipeline.files import sha256_file
from pipeline.layout import ONNX_NAME, PLAN, SAMPLE
from pipeline.trt import cache, flags, verify
from pipeline.trt.built import Built
from pipeline.trt.flags import Options
from pipeline.trt.profile import Profile
from pipeline.trt.runners import Runner
from pipeline.trt.trtexec import last_error, parse_sm, parse_version

CACHE = "timing.cache"
LOG = "trtexec.log"
HERE = "this host"
"""build.json's `built_by` and `verified_by` for this controller."""


@dataclass(frozen=True)
class Job:
    """What to build: the run dir's ONNX files, the profile, the options and the TensorRT version of the class."""

    klass: str
    run_path: Path
    staging: Path
    """Local directory receiving model.plan, timing.cache, trtexec.log (and the verification files)."""
    profile: Profile
    options: Options
    version: str
    """TensorRT version of the builder ("" when unknown: the plan version is then not checked)."""
    timeout_s: int
    jetpack: str = ""
    """JetPack of the device that builds ("" when unknown or not a device): DLA depends on it."""


def new_job(
    build: BuildConfig,
    run_path: Path,
    staging: Path,
    profile: Profile,
    klass: str,
    version: str,
    options: Options,
    jetpack: str = "",
) -> Job:
    """The job for `klass`, its timing cache seeded from the engine cache's (when there is one)."""
    seed = cache.timing_cache(build.cache_dir, klass)
    if seed.is_file():
        shutil.copyfile(seed, staging / CACHE)
    return Job(klass, run_path, staging, profile, options, version, build.timeout_s, jetpack)


async def build_and_verify(runner: Runner, job: Job, verify: bool, sample: Path) -> tuple[Built, dict[str, Any], float]:
    """Build on `runner` and verify there (unless `verify` is off): what was built, the checks, the build's seconds."""
    started = time.perf_counter()
    built = await build(runner, job)
    seconds = time.perf_counter() - started
    if not verify:
        return built, {"checked": False, "reason": "build.verify = false"}, seconds
    return built, await check(runner, job, sample if sample.is_file() else None), seconds


async def build(runner: Runner, job: Job) -> Built:
    """Build on `runner`; the engine, timing cache and log end up in `job.staging`."""
    chosen = flags.plan(job.version, job.options, job.run_path, job.jetpack)
    args, notes = flags.trtexec_args(job.version, chosen, job.options, job.profile)
    onnx = job.run_path / chosen.onnx
    await runner.put(onnx, ONNX_NAME)
    # What trtexec reads is checked where it reads it: an upload cut short or damaged never gets built.
    if await runner.sha256(ONNX_NAME) != sha256_file(onnx):
        raise PipelineError(f"build: {chosen.onnx} on {runner.where} does not match its sha256 here")
    if (job.staging / CACHE).is_file():
        await runner.put(job.staging / CACHE, CACHE)
    files = [f"--onnx={runner.path(ONNX_NAME)}", f"--saveEngine={runner.path(PLAN)}"]
    args = [*files, f"--timingCacheFile={runner.path(CACHE)}", *args]
    status, output = await runner.tool(args, job.staging / LOG, job.timeout_s)
    if status != 0:
        raise PipelineError(f"build: trtexec on {runner.where} exited with status {status}: {last_error(output)}")
    expected = await runner.sha256(PLAN)
    if expected is None or not await runner.get(PLAN, job.staging / PLAN):
        raise PipelineError(f"build: trtexec on {runner.where} exited 0 but wrote no engine: {last_error(output)}")
    if sha256_file(job.staging / PLAN) != expected:
        raise PipelineError(f"build: the engine fetched from {runner.where} does not match its sha256 there")
    await runner.get(CACHE, job.staging / CACHE)
    version = parse_version(output) or job.version
    command = [runner.exe, *args]
    return Built(version, parse_sm(output), chosen.precision, command, chosen.onnx, chosen.precision_flags, notes)


async def check(runner: Runner, job: Job, sample: Path | None) -> dict[str, Any]:
    """Verify the engine on `runner`; raises PipelineError when it fails, returns the facts for build.json."""
    facts: dict[str, Any] = {}
    if job.version and verify.has_plan_version(job.version):
        facts["plan_version"] = await _plan_version(runner, job)
    expected = None
    if sample is not None:
        expected = verify.write_input(sample, job.staging / "input.bin")
        await runner.put(job.staging / "input.bin", "input.bin")
    io = (runner.path("input.bin"), runner.path("output.json")) if sample is not None else None
    args = verify.load_args(runner.path(PLAN), job.profile, job.options.dla_core, io)
    status, output = await runner.tool(args, job.staging / "load.log", job.timeout_s)
    if status != 0:
        raise PipelineError(f"build: {job.klass}: the engine does not load on {runner.where}: {last_error(output)}")
    facts["loads"] = True
    facts["latency"] = verify.parse_latency(output)
    facts["outputs"] = await _outputs(runner, job, expected)
    return facts


async def _plan_version(runner: Runner, job: Job) -> str:
    """The engine's TensorRT version as `--getPlanVersionOnly` reads it; it must be the class's."""
    status, output = await runner.tool(verify.plan_version_args(runner.path(PLAN)), job.staging / "plan.log", 120)
    version = verify.parse_plan_version(output)
    if status != 0 or version is None:
        raise PipelineError(f"build: {job.klass}: trtexec --getPlanVersionOnly failed: {last_error(output)}")
    if not verify.same_version(version, job.version):
        raise PipelineError(f"build: {job.klass}: engine plan is TensorRT {version}, the class needs {job.version}")
    return version


async def _outputs(runner: Runner, job: Job, expected: Any) -> dict[str, Any]:
    """Compare the exported outputs with ONNX Runtime's; a trtexec that exported nothing leaves them unchecked."""
    if expected is None:
        return {"checked": False, "reason": f"{SAMPLE} is missing (export stage writes it)"}
    if not await runner.get("output.json", job.staging / "output.json"):
        return {"checked": False, "reason": f"trtexec on {runner.where} wrote no --exportOutput file"}
    try:
        logits = verify.read_output(job.staging / "output.json")
    except (ValueError, KeyError) as err:
        raise PipelineError(f"build: {job.klass}: unreadable trtexec output JSON: {err}") from None
    verdict = verify.agreement(job.options.precision, logits, expected)
    if not verdict["passed"]:
        raise PipelineError(
            f"build: {job.klass}: engine disagrees with ONNX Runtime on onnx/sample.npz: {verdict['reason']}"
        )
    return {"checked": True, **verdict}


def build_info(job: Job, klass: BuildClass, built: Built, checks: dict[str, Any], seconds: float) -> dict[str, Any]:
    """build.json of a freshly built engine: one set of fields wherever it was built (the engine cache adds `cache`
    when it publishes it)."""
    key_dict = cache.key_parts(job.run_path, klass.name, job.version, job.options, job.profile)
    return {
        "class": klass.name,
        "builder": klass.builder,
        "target": klass.target or None,
        "built_by": klass.target or HERE,
        "verified_by": _verifier(klass, checks),
        "peer_check": None,
        "tensorrt_version": built.tensorrt_version or job.version,
        "sm": klass.sm or built.sm,
        "l4t": klass.l4t or None,
        "precision": built.precision,
        "onnx": built.onnx,
        "precision_flags": built.precision_flags,
        "workspace_mb": job.options.workspace_mb,
        "opt_level": job.options.opt_level,
        "dla_core": job.options.dla_core,
        "input": job.profile.name,
        "shapes": job.profile.to_dict(),
        "command": shlex.join(built.command) if built.command else None,
        "notes": built.notes,
        "seconds": round(seconds, 3),
        "onnx_sha256": key_dict["onnx_sha256"],
        "engine_sha256": sha256_file(job.staging / PLAN),
        "cache_key": cache.engine_key(key_dict),
        "verification": checks,
        "latency": checks.get("latency", {}),
    }


def _verifier(klass: BuildClass, checks: dict[str, Any]) -> str | None:
    """Who vouches for the engine to others: this host's own check, never the device that built it (a second device
    of its class may: pipeline.trt.peer)."""
    return HERE if klass.builder != "device" and checks.get("loads") else None
