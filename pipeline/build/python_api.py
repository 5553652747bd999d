"""Engine builds with the TensorRT Python API (needs `import tensorrt` and a CUDA GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.build.built import Built
from pipeline.build.device import local_sm, trt_major
from pipeline.build.profile import Profile
from pipeline.errors import PipelineError


def tensorrt_version() -> str:
    """Installed TensorRT as major.minor.patch ("10.3.0.30" → "10.3.0")."""
    import tensorrt as trt

    return ".".join(trt.__version__.split(".")[:3])


def build(
    onnx: Path,
    staging: Path,
    profile: Profile,
    precision: str,
    workspace_mb: int,
    log: Callable[[str], None] = print,
) -> Built:
    """Parse `onnx`, build with one optimization profile, write `staging/model.plan` and `staging/timing.cache`."""
    import tensorrt as trt

    version = tensorrt_version()
    major = trt_major(version) or 0
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TensorRT 10 made explicit batch the only mode and deprecated the flag; 8.x still needs it.
    flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise PipelineError(f"{onnx}: TensorRT cannot parse it: {errors[0] if errors else 'unknown parser error'}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    # TensorRT 11 is strongly typed: precision comes from the ONNX graph and the FP16 flag no longer exists.
    fp16 = precision == "fp16" and major < 11
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    shapes = builder.create_optimization_profile()
    shapes.set_shape(profile.name, profile.shape(1), profile.shape(profile.opt), profile.shape(profile.max))
    config.add_optimization_profile(shapes)
    cache_path = staging / "timing.cache"
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)

    log(f"[build] TensorRT {version} Python API: building ({'fp16' if fp16 else 'fp32'} flags)")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PipelineError(f"{onnx}: TensorRT {version} failed to build an engine (see its log above)")
    (staging / "model.plan").write_bytes(bytes(serialized))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return Built(version, local_sm(), fp16)
