"""Which ONNX file and which builder options a TensorRT version takes: the version matrix in one place.

Before TensorRT 11 precision is a builder flag (`--fp16`, `--int8`) on the fp32 graph, or for int8 on the explicit
Q/DQ graph. TensorRT 11 is strongly typed: the flags are gone and the precision comes from the ONNX variant itself.
`--workspace=N` became `--memPoolSize=workspace:N` in 8.4 (and was removed in 10); `--builderOptimizationLevel` and
`--skipInference` (formerly `--buildOnly`) arrived in 8.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import BuildClass, BuildConfig
from pipeline.errors import PipelineError
from pipeline.layout import onnx_path
from pipeline.trt.profile import Profile


def version_tuple(version: str | None) -> tuple[int, int]:
    """(major, minor) of "10.3.0"; an unknown version counts as 10.0, the oldest TensorRT still current."""
    if not version:
        return (10, 0)
    parts = [int(p) for p in version.split(".")[:2]]
    return (parts[0], parts[1] if len(parts) > 1 else 0)


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
    notes: list[str] = field(default_factory=list)


def plan(version: str | None, options: Options, run_path: Path) -> Plan:
    """The ONNX file and precision flags for `version`; a variant TensorRT 11 needs but export did not write is an
    error naming export.variants."""
    major = version_tuple(version)[0]
    precision = options.precision
    if major >= 11:
        rel = onnx_path(precision)
        _require(run_path, rel, precision, f"TensorRT {version} is strongly typed")
        return Plan(rel, [], strongly_typed=True)
    if precision == "int8":
        rel = onnx_path("int8")
        _require(run_path, rel, precision, "int8 engines are built from the explicit Q/DQ graph")
        return Plan(rel, ["--int8"], strongly_typed=False)
    flags = ["--fp16"] if precision == "fp16" else []
    return Plan(onnx_path("fp32"), flags, strongly_typed=False)


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
    args.append(f"--memPoolSize=workspace:{workspace}M" if ver >= (8, 4) else f"--workspace={workspace}")
    args += build.precision_flags
    notes = list(build.notes)
    if options.opt_level is not None:
        if ver >= (8, 6):
            args.append(f"--builderOptimizationLevel={options.opt_level}")
        else:
            notes.append(f"builderOptimizationLevel {options.opt_level} ignored: TensorRT {version} predates 8.6")
    if options.dla_core is not None:
        args += [f"--useDLACore={options.dla_core}", "--allowGPUFallback"]
    # Build only: the benchmark run would add minutes on a small Jetson (verification times the engine instead).
    args.append("--skipInference" if ver >= (8, 6) else "--buildOnly")
    return args, notes


def python_api_flags(version: str | None, options: Options) -> dict[str, list[str]]:
    """Names of the NetworkDefinitionCreationFlag and BuilderFlag members the Python API build sets for `version`."""
    major = version_tuple(version)[0]
    network = ["EXPLICIT_BATCH"] if major < 10 else []
    if major >= 11:
        network.append("STRONGLY_TYPED")
    builder = {"fp16": ["FP16"], "int8": ["INT8"]}.get(options.precision, []) if major < 11 else []
    if options.dla_core is not None:
        builder.append("GPU_FALLBACK")
    return {"network": network, "builder": builder}
