"""The build stage: TensorRT engines published under `engines/<class>/`, one per device class.

Without `build.classes` the one class is this host's (`local-<sm>-trt<version>`), built by this host's builder through
the same path as a declared class (pipeline.engines.build): engine cache, staging, verification, build.json. Without
TensorRT the stage is skipped with the reason, never faked.

Caching: the engine cache serves every class. This host's build is also cached as a stage, keyed on the host's
fingerprint (builder, TensorRT version, GPU), so an unchanged re-run is `cached` without building or copying anything;
declared classes depend on builders outside the run (other executables, devices over SSH) that no fingerprint here
covers, so that stage always runs and the engine cache makes each unchanged class a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from pipeline.config import BuildClass, Config
from pipeline.engines import build
from pipeline.engines.detect import Host, choose, probe_host
from pipeline.errors import PipelineError, TransientError
from pipeline.files import write_json
from pipeline.fleet.classes import from_inventory
from pipeline.fleet.inventory import load_inventory
from pipeline.layout import BUILD_INFO_KEY, CLASSES, ENGINE_KEY, ONNX, engine_keys
from pipeline.manifest import RunDir, Stage, StageResult, run_stage
from pipeline.trt.profile import input_profile


def run(cfg: Config, run: RunDir, log: Callable[[str], None] = print) -> StageResult:
    """Build `engines/<class>/model.plan` from `onnx/model.onnx`, or skip with the reason when TensorRT is absent.

    With `build.classes` (or `build.from_inventory`) one engine per device class; the stage then always runs (the
    builders' TensorRT lives outside the run) and the engine cache makes unchanged classes a copy.
    """
    if cfg.build.classes or cfg.build.from_inventory:
        body = partial(_classes_body, cfg, run, log)
        return run_stage(run, cfg, STAGE, body, log, cacheable=False)
    host = probe_host(choose(cfg.build))
    external = {"tensorrt": host.fingerprint()} if host.choice.builder else None
    body = partial(_host_body, cfg, run, host, log)
    return run_stage(run, cfg, STAGE, body, log, external=external)


def _context(cfg: Config, run: RunDir, log: Callable[[str], None]) -> build.Context:
    return build.Context(cfg, run, input_profile(run.path / ONNX, cfg.export), log)


def _host_body(cfg: Config, run: RunDir, host: Host, log: Callable[[str], None]) -> StageResult:
    if host.choice.builder is None:
        return StageResult("build", "skipped", reason=host.choice.reason)
    row = build.build_host(_context(cfg, run, log), host)
    engine_bytes = (run.path / row["engine"]).stat().st_size
    return StageResult(
        "build",
        "done",
        outputs={ENGINE_KEY: row["engine"], BUILD_INFO_KEY: row["build_info"]},
        metrics={
            "engine_mb": round(engine_bytes / 1e6, 6),
            "engine_bytes": engine_bytes,
            "class": row["class"],
            "builder": row["builder"],
            "tensorrt_version": row["tensorrt_version"],
            "build_seconds": row["seconds"],
            "cache": row["cache"],
        },
    )


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
    ctx = _context(cfg, run, log)
    rows: list[dict[str, Any]] = []
    errors: dict[str, PipelineError] = {}
    for klass in declared_classes(cfg, log):
        try:
            rows.append(build.build_class(ctx, klass))
        except PipelineError as err:
            errors[klass.name] = err
    write_json(run.path / CLASSES, rows)
    if errors:
        # A retry can only cure the stage when every failure was an unreachable build device.
        kind = TransientError if all(isinstance(e, TransientError) for e in errors.values()) else PipelineError
        detail = "; ".join(f"{name}: {err}" for name, err in errors.items())
        raise kind(f"build: {len(errors)} class(es) failed: {detail}")
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
    outputs = {ENGINE_KEY: made[0]["engine"], BUILD_INFO_KEY: made[0]["build_info"], "classes": CLASSES}
    metrics["engine_mb"] = round((run.path / made[0]["engine"]).stat().st_size / 1e6, 6)
    for row in made:
        engine, info = engine_keys(row["class"])
        outputs |= {engine: row["engine"], info: row["build_info"]}
    return StageResult("build", "done", outputs=outputs, metrics=metrics)


STAGE = Stage(name="build", sections=("build", "export"), inputs=(ONNX,), outputs={}, run=run)
"""Outputs depend on the device classes: `engine:<class>` and `build_info:<class>` per engine, `classes`."""
