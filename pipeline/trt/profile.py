"""The optimization profile of the engine: min/opt/max shapes of the ONNX input's dynamic batch axis."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from pipeline.config import ExportConfig
from pipeline.errors import PipelineError

INPUT_NAME = "input"


@dataclass(frozen=True)
class Profile:
    """Shapes for the input tensor: batch 1, `opt`, `max` over a fixed (C, H, W)."""

    chw: tuple[int, int, int]
    opt: int
    max: int
    name: str = INPUT_NAME

    def shape(self, batch: int) -> tuple[int, int, int, int]:
        """NCHW shape at `batch`."""
        return (batch, *self.chw)

    def spec(self, batch: int) -> str:
        """trtexec shape spec, e.g. "input:8x1x16x16"."""
        return f"{self.name}:" + "x".join(str(d) for d in self.shape(batch))

    def to_dict(self) -> dict[str, list[int]]:
        """{"min": [...], "opt": [...], "max": [...]} for build.json."""
        return {"min": list(self.shape(1)), "opt": list(self.shape(self.opt)), "max": list(self.shape(self.max))}


def input_chw(onnx_path: Path) -> tuple[int, int, int]:
    """The static (C, H, W) of the ONNX input named "input"; everything but the batch axis must be fixed."""
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except (DecodeError, OSError) as err:
        raise PipelineError(f"{onnx_path}: not a readable ONNX model: {err}") from None
    inputs = {i.name: i for i in model.graph.input}
    if INPUT_NAME not in inputs:
        raise PipelineError(f"{onnx_path}: no input named {INPUT_NAME!r} (found: {', '.join(inputs) or 'none'})")
    dims = [d.dim_value for d in inputs[INPUT_NAME].type.tensor_type.shape.dim]
    if len(dims) != 4 or min(dims[1:]) <= 0:
        raise PipelineError(f"{onnx_path}: input {INPUT_NAME!r} must be NCHW with fixed C, H, W (got {dims})")
    return dims[1], dims[2], dims[3]


def input_profile(onnx_path: Path, export: ExportConfig) -> Profile:
    """The profile for `onnx_path`: batch 1 up to `export.max_batch`, tuned for `export.opt_batch`."""
    return Profile(input_chw(onnx_path), opt=export.opt_batch, max=export.max_batch)
