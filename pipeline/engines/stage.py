"""The build stage: TensorRT engines published under `engines/<class>/`, one per device class.

Without `build.classes` it builds for this host's class (pipeline.engines.build handles declared classes). An engine
is built in a staging directory, verified, and moved into place only when all of that succeeded, so a failed or
interrupted build never replaces a good engine. Without TensorRT the stage is skipped, never faked.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.config import BuildClass, Config
from pipeline.engines import build, engine_job, python_api, trtexec
from pipeline.engines.built import Built
from pipeline.engines.detect import Choice, choose
from pipeline.engines.engine_job import Job
from pipeline.engines.flags import Options
from pipeline.engines.profile import Profile, input_profile
from pipeline.engines.runners import Local
from pipeline.errors import PipelineError
from pipeline.files import sha256_file, write_json
from pipeline.fleet.classes import device_class, from_inventory
from pipeline.fleet.inventory import load_inventory
from pipeline.host import local_sm
from pipeline.layout import BUILD_INFO, CLASSES, ENGINES, ONNX, PLAN, SAMPLE
from pipeline.manifest import RunDir, StageResult, run_stage

FAILED_LOG = "build-failed.log"


@dataclass(frozen=True)
class Host:
    """The chosen builder and what is known about this host before building."""

    choice: Choice
    tensorrt_version: str | None = None
    sm: str | None = None

    def fingerprint(self) -> str:
        """Part of the cache key: a new TensorRT or GPU makes the cached engine stale."""
        return f"{self.choice.builder} {self.tensorrt_version or '?'} {self.sm or '?'}"


def probe_host(choice: Choice) -> Host:
    """Learn the TensorRT version and GPU of the chosen builder (nothing for "no builder")."""
    if choice.builder == "python":
        return Host(choice, python_api.tensorrt_version(), local_sm())
    if choice.builder == "trtexec":
        assert choice.trtexec is not None
        with tempfile.TemporaryDirectory() as scratch:
            version = trtexec.probe_version(choice.trtexec, Path(scratch))
        return Host(choice, version, local_sm())
    return Host(choice)


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Build `engines/<class>/model.plan` from `onnx/model.onnx`, or skip with the reason when TensorRT is absent.

    With `build.classes` (or `build.from_inventory`) one engine per device class; the stage then always runs (the
    builders' TensorRT lives outside the run) and the engine cache makes unchanged classes a copy.
    """
    if cfg.build.classes or cfg.build.from_inventory:
        body = partial(_classes_body, cfg, run, log)
        return run_stage(run, cfg, "build", ("build", "export"), [ONNX], body, log, cacheable=False)
    host = probe_host(choose(cfg.build))
    external = {"tensorrt": host.fingerprint()} if host.choice.builder else None
    return run_stage(
        run, cfg, "build", ("build", "export"), [ONNX], lambda: _body(cfg, run, host, log), log, external=external
    )


def _body(cfg: Config, run: RunDir, host: Host, log: Callable[[str], None]) -> StageResult:
    if host.choice.builder is None:
        return StageResult("build", "skipped", reason=host.choice.reason)
    onnx = run.path / ONNX
    profile = input_profile(onnx, cfg.export)
    engines = run.path / ENGINES
    staging = engines / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _seed_timing_cache(_known_class_dir(engines, host), staging)
        started = time.perf_counter()
        built = _build(cfg, host, run, staging, profile, log)
        seconds = round(time.perf_counter() - started, 3)
        klass = device_class(host.sm or built.sm, built.tensorrt_version)
        info = _build_info(cfg, host, built, profile, klass, seconds, onnx)
        info["verification"] = _verify_here(cfg, host, run, staging, profile, klass, built)
        info["latency"] = info["verification"].get("latency", {})
        dest = _publish(staging, engines / klass, info)
    except PipelineError as err:
        kept = _keep_failed_log(staging, engines)
        if kept is None:
            raise
        raise PipelineError(f"{err} (full log: {kept})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    (engines / FAILED_LOG).unlink(missing_ok=True)
    engine = dest / PLAN
    log(f"[build] {host.choice.builder}: {_rel(engine, run)} ({engine.stat().st_size / 1e6:.1f} MB)")
    return StageResult(
        "build",
        "done",
        outputs={"engine": _rel(engine, run), "build_info": _rel(dest / BUILD_INFO, run)},
        metrics={
            "engine_mb": round(engine.stat().st_size / 1e6, 6),
            "engine_bytes": engine.stat().st_size,
            "class": klass,
            "builder": host.choice.builder,
            "tensorrt_version": built.tensorrt_version,
            "build_seconds": seconds,
        },
    )


def _build(cfg: Config, host: Host, run: RunDir, staging: Path, profile: Profile, log: Callable[[str], None]) -> Built:
    options = Options(cfg.build.precision, cfg.build.workspace_mb, cfg.build.opt_level)
    if host.choice.builder == "python":
        return python_api.build(run.path, staging, profile, options, log)
    assert host.choice.trtexec is not None
    version = host.tensorrt_version or "version unknown"
    log(f"[build] trtexec (TensorRT {version}): building, limit {cfg.build.timeout_s}s")
    return trtexec.build(
        host.choice.trtexec, run.path, staging, profile, options, host.tensorrt_version, cfg.build.timeout_s
    )


def _verify_here(
    cfg: Config, host: Host, run: RunDir, staging: Path, profile: Profile, klass: str, built: Built
) -> dict[str, Any]:
    """Verify this host's engine with its trtexec (the Python API builder: with `build.trtexec` when on PATH)."""
    exe = host.choice.trtexec or shutil.which(cfg.build.trtexec)
    if not cfg.build.verify or exe is None:
        why = "build.verify = false" if not cfg.build.verify else f"no trtexec here ({cfg.build.trtexec!r})"
        return {"checked": False, "reason": why}
    options = Options(cfg.build.precision, cfg.build.workspace_mb, cfg.build.opt_level)
    job = Job(klass, run.path, staging, profile, options, built.tensorrt_version or "", cfg.build.timeout_s)
    sample = run.path / SAMPLE
    return asyncio.run(engine_job.check(Local(exe, staging), job, sample if sample.is_file() else None))


def _known_class_dir(engines: Path, host: Host) -> Path | None:
    """The class directory of an earlier build on this host, before this build has revealed the GPU.

    trtexec reports the compute capability only while building, so without torch/nvidia-smi the one earlier
    class with this TensorRT version stands for this host.
    """
    if host.sm is not None:
        return engines / device_class(host.sm, host.tensorrt_version)
    earlier = sorted(engines.glob(f"local-sm*-trt{host.tensorrt_version}")) if host.tensorrt_version else []
    return earlier[0] if len(earlier) == 1 else None


def _seed_timing_cache(class_dir: Path | None, staging: Path) -> None:
    """Start from the class's timing cache: rebuilds then skip most tactic timing (slow on small Jetsons)."""
    cache = class_dir / "timing.cache" if class_dir else None
    if cache is not None and cache.is_file():
        shutil.copyfile(cache, staging / "timing.cache")


def _build_info(
    cfg: Config, host: Host, built: Built, profile: Profile, klass: str, seconds: float, onnx: Path
) -> dict[str, Any]:
    return {
        "class": klass,
        "builder": host.choice.builder,
        "tensorrt_version": built.tensorrt_version,
        "sm": host.sm or built.sm,
        "precision": cfg.build.precision,
        "fp16_flag": built.fp16,
        "precision_flags": built.precision_flags,
        "onnx": built.onnx,
        "notes": built.notes,
        "workspace_mb": cfg.build.workspace_mb,
        "input": profile.name,
        "shapes": profile.to_dict(),
        "seconds": seconds,
        "command": shlex.join(built.command) if built.command else None,
        "onnx_sha256": sha256_file(onnx.parent.parent / built.onnx),
    }


def _publish(staging: Path, dest: Path, info: dict[str, Any]) -> Path:
    """Move the built files into `dest` (one rename each) and write build.json last, as the completion mark."""
    dest.mkdir(parents=True, exist_ok=True)
    for src, name in ((PLAN, PLAN), ("timing.cache", "timing.cache"), ("trtexec.log", "build.log")):
        if (staging / src).is_file():
            os.replace(staging / src, dest / name)
    write_json(dest / BUILD_INFO, info)
    return dest


def _rel(path: Path, run: RunDir) -> str:
    return str(path.relative_to(run.path))


def _keep_failed_log(staging: Path, engines: Path) -> Path | None:
    """Keep trtexec's output of a failed build where the user can read it; None when there is none."""
    log = staging / "trtexec.log"
    if not log.is_file():
        return None
    os.replace(log, engines / FAILED_LOG)
    return engines / FAILED_LOG


def declared_classes(cfg: Config, log: Callable[[str], None]) -> list[BuildClass]:
    """`build.classes`, plus the classes the inventory's devices report when `build.from_inventory` is set."""
    classes = list(cfg.build.classes)
    if cfg.build.from_inventory:
        if cfg.deploy.inventory is None:
            raise PipelineError("build.from_inventory: needs deploy.inventory (the devices to probe)")
        known = {k.name for k in classes}
        found = from_inventory(load_inventory(cfg.deploy.inventory), log)
        classes += [k for k in found if k.name not in known]
    return classes


def _classes_body(cfg: Config, run: RunDir, log: Callable[[str], None]) -> StageResult:
    ctx = build.Context(cfg, run, input_profile(run.path / ONNX, cfg.export), log)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    for klass in declared_classes(cfg, log):
        try:
            rows.append(build.build_class(ctx, klass))
        except PipelineError as err:
            errors.append(f"{klass.name}: {err}")
    write_json(run.path / CLASSES, rows)
    if errors:
        raise PipelineError(f"build: {len(errors)} class(es) failed: {'; '.join(errors)}")
    made = [row for row in rows if row["status"] != build.NOT_BUILT]
    metrics = {
        "classes": {row["class"]: row for row in rows},
        "engines": len(made),
        "cache_hits": sum(row["cache"] == "hit" for row in rows),
        "not_built": len(rows) - len(made),
    }
    if not made:
        reason = "; ".join(f"{row['class']}: not built: {row['reason']}" for row in rows) or "no device classes"
        return StageResult("build", "skipped", outputs={"classes": CLASSES}, metrics=metrics, reason=reason)
    outputs = {"engine": made[0]["engine"], "build_info": made[0]["build_info"], "classes": CLASSES}
    metrics["engine_mb"] = round((run.path / made[0]["engine"]).stat().st_size / 1e6, 6)
    for row in made:
        outputs |= {f"engine:{row['class']}": row["engine"], f"build_info:{row['class']}": row["build_info"]}
    return StageResult("build", "done", outputs=outputs, metrics=metrics)
