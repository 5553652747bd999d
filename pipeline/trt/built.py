"""What a builder reports back about the engine it wrote."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.layout import ONNX


@dataclass(frozen=True)
class Built:
    """Facts learnt while building: they decide the device class and go into build.json."""

    tensorrt_version: str | None
    sm: str | None
    precision: str
    """The precision the engine has: set by builder flags before TensorRT 11, by the ONNX variant's types from 11."""
    command: list[str] | None = None
    """The trtexec command line; None for the Python API."""
    onnx: str = ONNX
    """Run-dir-relative ONNX file the engine was built from."""
    precision_flags: list[str] = field(default_factory=list)
    """Precision flags passed (`--fp16`, `--int8`, or BuilderFlag names); none on TensorRT >= 11, which is strongly
    typed."""
    notes: list[str] = field(default_factory=list)
    """Requested options this TensorRT version does not have (ignored)."""
