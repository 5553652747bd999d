"""Engine builds with the TensorRT Python API (needs `import tensorrt` and a CUDA GPU).

Which flags a version takes is pipeline.trt.flags (`python_api_flags`); the calls it makes are checked in
docs/tensorrt.md#python-api-build-calls.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.host import local_sm
from pipeline.layout import PLAN
from pipeline.trt import flags
from pipeline.trt.built import Built
from pipeline.trt.flags import Options
from pipeline.trt.profile import Profile


def tensorrt_version() -> str:
    """Installed TensorRT as major.minor.patch ("10.3.0.30" → "10.3.0")."""
    import tensorrt as trt

    return ".".join(trt.__version__.split(".")[:3])


def build(
    run_path: Path, staging: Path, profile: Profile, options: Options, log: Callable[[str], None] = print
) -> Built:
    """Parse the ONNX file the version needs, build with one optimization profile, write `staging/model.plan` and
    `staging/timing.cache` (seeded from a timing cache already there)."""
    import tensorrt as trt

    version = tensorrt_version()
    chosen = flags.plan(version, options, run_path)
    wanted = flags.python_api_flags(version, options)
    onnx = run_path / chosen.onnx
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network_flags = 0
    for name in wanted["network"]:
        network_flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(network_flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise PipelineError(f"{onnx}: TensorRT cannot parse it: {errors[0] if errors else 'unknown parser error'}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb << 20)
    for name in wanted["builder"]:
        config.set_flag(getattr(trt.BuilderFlag, name))
    notes = _set_levels(trt, config, version, options)
    shapes = builder.create_optimization_profile()
    shapes.set_shape(profile.name, profile.shape(1), profile.shape(profile.opt), profile.shape(profile.max))
    config.add_optimization_profile(shapes)
    cache_path = staging / "timing.cache"
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)

    log(f"[build] TensorRT {version} Python API: building {chosen.onnx} (flags: {wanted['builder'] or 'none'})")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PipelineError(f"{onnx}: TensorRT {version} failed to build an engine (see its log above)")
    (staging / PLAN).write_bytes(bytes(serialized))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return Built(version, local_sm(), chosen.precision, None, chosen.onnx, wanted["builder"], notes)


def _set_levels(trt: Any, config: Any, version: str, options: Options) -> list[str]:
    """Optimisation level and DLA core; returns notes on what this version lacks."""
    notes = []
    if options.opt_level is not None:
        if flags.version_tuple(version) >= flags.OPT_LEVEL_SINCE:
            config.builder_optimization_level = options.opt_level
        else:
            notes.append(f"builder_optimization_level {options.opt_level} ignored: TensorRT {version} predates 8.6")
    if options.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = options.dla_core
    return notes
