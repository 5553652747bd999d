"""Which ONNX file and which builder options a TensorRT version takes: the version matrix in one place.

Before TensorRT 11 precision is a builder flag (`--fp16`, `--int8`) on the fp32 graph, or for int8 on the explicit
Q/DQ graph. TensorRT 11 is strongly typed: the flags are gone and the precision comes from the ONNX variant itself.
Every version threshold here is a fact in docs/tensorrt.md, with its source; the comments name the section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import BuildClass, BuildConfig
from pipeline.errors import PipelineError
from pipeline.layout import onnx_path
from pipeline.trt.profile import Profile

MEMPOOL_SINCE = (8, 4)
"""`--memPoolSize` replaced `--workspace` (docs/tensorrt.md#workspace-limit-and-its-unit)."""
SKIP_INFERENCE_SINCE = (8, 6)
"""`--skipInference`; only `--buildOnly` before, removed in 10.0 (docs/tensorrt.md#build-without-inference)."""
OPT_LEVEL_SINCE = (8, 6)
"""`--builderOptimizationLevel` and `builder_optimization_level` (docs/tensorrt.md#builder-optimization-level)."""
PLAN_VERSION_SINCE = (9, 1)
"""`--getPlanVersionOnly` (docs/tensorrt.md#plan-version-check)."""
IMPLICIT_EXPLICIT_BATCH = (10, 0)
"""Networks are always explicit batch; `EXPLICIT_BATCH` is needed before (docs/tensorrt.md#python-api-network-flags)."""
STRONGLY_TYPED_ONLY = (11, 0)
"""No precision flags in trtexec or the Python API (docs/tensorrt.md#precision-flags-removed-in-11)."""
DLA_GAP = ((10, 8, 0), (11, 4, 1))
"""TensorRT releases without DLA: after 10.7, until 11.4.1 (docs/tensorrt.md#dla-cores)."""
DLA_JETPACK = (7, 2, 2)
"""11.4.1 and later have DLA on JetPack 7.2.2 and later only (docs/tensorrt.md#dla-cores)."""


def release(version: str | None) -> tuple[int, int, int]:
    """(major, minor, patch) of "10.3.0.30" or "7.2.2-b40"; missing parts are 0."""
    numbers = [int(p) for p in (version or "").split("-")[0].split(".")[:3] if p.isdigit()]
    major, minor, patch = [*numbers, 0, 0, 0][:3]
    return major, minor, patch


def version_tuple(version: str | None) -> tuple[int, int]:
    """(major, minor) of "10.3.0"; an unknown version counts as 10.0, the oldest TensorRT still current."""
    return release(version)[:2] if version else (10, 0)


@dataclass(frozen=True)
class Options:
    """Builder options that change the engine (all of them are part of the engine cache key)."""

    precision: str
    workspace_mb: int
    opt_level: int | None = None
    dla_core: int | None = None

    def key(self) -> dict[str, object]:
        """The options as a JSON-friendly dict."""
        return {
            "precision": self.precision,
            "workspace_mb": self.workspace_mb,
            "opt_level": self.opt_level,
            "dla_core": self.dla_core,
        }


def options_for(build: BuildConfig, klass: BuildClass) -> Options:
    """The class's builder options: its own values, else the build section's."""
    workspace = klass.workspace_mb or build.workspace_mb
    opt_level = klass.opt_level if klass.opt_level is not None else build.opt_level
    return Options(build.precision, workspace, opt_level, klass.dla_core)


@dataclass(frozen=True)
class Plan:
    """What to build for one (TensorRT version, options): the ONNX file, the flags, and notes for build.json."""

    onnx: str
    """Run-dir-relative ONNX file to build."""
    precision_flags: list[str]
    strongly_typed: bool
    precision: str
    """The precision the engine has: from the builder flags before 11, from the ONNX variant's types from 11."""
    notes: list[str] = field(default_factory=list)


def dla_problem(version: str | None, jetpack: str = "") -> str | None:
    """Why TensorRT `version` (on JetPack `jetpack`, when known) cannot build for a DLA core; None when it can."""
    have = release(version)
    if DLA_GAP[0] <= have < DLA_GAP[1]:
        return f"TensorRT {version} has no DLA (10.7 was the last release with it; it came back in 11.4.1)"
    if have >= DLA_GAP[1] and jetpack and release(jetpack) < DLA_JETPACK:
        return f"TensorRT {version} has DLA only on JetPack 7.2.2 and later (this device runs JetPack {jetpack})"
    return None


def plan(version: str | None, options: Options, run_path: Path, jetpack: str = "") -> Plan:
    """The ONNX file and precision flags for `version`; a variant TensorRT 11 needs but export did not write, or a
    DLA core this version has none of, is an error naming the setting."""
    precision = options.precision
    if options.dla_core is not None and (problem := dla_problem(version, jetpack)):
        raise PipelineError(f"dla_core = {options.dla_core}: {problem}")
    if version_tuple(version) >= STRONGLY_TYPED_ONLY:
        rel = onnx_path(precision)
        _require(run_path, rel, precision, f"TensorRT {version} is strongly typed")
        return Plan(rel, [], strongly_typed=True, precision=precision)
    if precision == "int8":
        rel = onnx_path("int8")
        _require(run_path, rel, precision, "int8 engines are built from the explicit Q/DQ graph")
        return Plan(rel, ["--int8"], strongly_typed=False, precision=precision)
    flags = ["--fp16"] if precision == "fp16" else []
    return Plan(onnx_path("fp32"), flags, strongly_typed=False, precision=precision)


def _require(run_path: Path, rel: str, precision: str, why: str) -> None:
    if not (run_path / rel).is_file():
        raise PipelineError(
            f"export.variants: {rel} is missing and {why}: add {precision!r} to export.variants and rerun export"
        )


def trtexec_args(version: str | None, build: Plan, options: Options, profile: Profile) -> tuple[list[str], list[str]]:
    """Options (without --onnx/--saveEngine/--timingCacheFile) for `version`, and notes on options it lacks."""
    ver = version_tuple(version)
    args = [
        f"--minShapes={profile.spec(1)}",
        f"--optShapes={profile.spec(profile.opt)}",
        f"--maxShapes={profile.spec(profile.max)}",
    ]
    workspace = options.workspace_mb
    # A plain number: MiB in every version, while 10.0.x counts an `M` suffix twice, so no limit at all
    # (docs/tensorrt.md#workspace-limit-and-its-unit).
    args.append(f"--memPoolSize=workspace:{workspace}" if ver >= MEMPOOL_SINCE else f"--workspace={workspace}")
    args += build.precision_flags
    notes = list(build.notes)
    if options.opt_level is not None:
        if ver >= OPT_LEVEL_SINCE:
            args.append(f"--builderOptimizationLevel={options.opt_level}")
        else:
            notes.append(f"builderOptimizationLevel {options.opt_level} ignored: TensorRT {version} predates 8.6")
    if options.dla_core is not None:
        args += [f"--useDLACore={options.dla_core}", "--allowGPUFallback"]
    # Build only: the benchmark run would add minutes on a small Jetson (verification times the engine instead).
    args.append("--skipInference" if ver >= SKIP_INFERENCE_SINCE else "--buildOnly")
    return args, notes


def python_api_flags(version: str | None, options: Options) -> dict[str, list[str]]:
    """Names of the NetworkDefinitionCreationFlag and BuilderFlag members the Python API build sets for `version`."""
    ver = version_tuple(version)
    network = ["EXPLICIT_BATCH"] if ver < IMPLICIT_EXPLICIT_BATCH else []
    # From 11 every network is strongly typed: STRONGLY_TYPED is ignored and FP16/INT8 are gone
    # (docs/tensorrt.md#python-api-network-flags, #python-api-precision-flags).
    builder = {"fp16": ["FP16"], "int8": ["INT8"]}.get(options.precision, []) if ver < STRONGLY_TYPED_ONLY else []
    if options.dla_core is not None:
        builder.append("GPU_FALLBACK")
    return {"network": network, "builder": builder}
