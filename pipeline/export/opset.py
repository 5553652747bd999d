"""Which opset the oldest TensorRT among the targets parses, and lowering a graph to it.

The dynamo exporter writes opset 18 or newer; JetPack 5's TensorRT 8.5 parses at most 17
(docs/tensorrt.md#onnx-opsets-per-release). ONNX's own version converter does the lowering (onnxscript's converter
only handles 18 and up).
"""

from __future__ import annotations

import onnx
from onnx import version_converter

from pipeline.errors import PipelineError

TENSORRT_MAX_OPSET: tuple[tuple[tuple[int, int], int], ...] = (
    ((8, 2), 13),
    ((8, 4), 17),
    ((9, 0), 19),
    ((10, 0), 20),
    ((10, 15), 24),
    ((11, 0), 25),
)
"""(first TensorRT version, highest opset its ONNX parser accepts), per docs/tensorrt.md#onnx-opsets-per-release:
onnx-tensorrt's docs/operators.md per release branch for 8.2 to 10.1 (confirmed), NVIDIA's ONNX opset guide for 11.x
(25, confirmed). 10.2 to 10.14 are held at 20, what 10.0 and 10.1 document (not confirmed for them); 10.15's 24 was
seen in a text whose repository was not named (not confirmed)."""

# Opset 18 gave these reductions `noop_with_empty_axes` (ReduceSum had it since 13); the converter keeps it.
_REDUCE_GAINED_NOOP_IN_18 = {
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
}


def parse_version(text: str) -> tuple[int, int]:
    """("8.5") → (8, 5); the config validator has already checked the "major.minor" shape."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def tensorrt_max_opset(version: str) -> int:
    """The highest opset TensorRT `version` parses, or a one-line error for versions older than the table."""
    wanted = parse_version(version)
    known = [opset for first, opset in TENSORRT_MAX_OPSET if first <= wanted]
    if not known:
        oldest = ".".join(map(str, TENSORRT_MAX_OPSET[0][0]))
        raise PipelineError(f"export.min_tensorrt: TensorRT {version} is older than the oldest supported ({oldest})")
    return known[-1]


def choose(min_tensorrt: str, requested: int) -> tuple[int, str]:
    """(opset, why): the requested opset, lowered to what TensorRT `min_tensorrt` parses."""
    limit = tensorrt_max_opset(min_tensorrt)
    if requested <= limit:
        return requested, f"export.opset {requested} (TensorRT {min_tensorrt} parses up to {limit})"
    return limit, f"TensorRT {min_tensorrt} (export.min_tensorrt) parses up to opset {limit}"


def lower(proto: onnx.ModelProto, target: int, what: str) -> onnx.ModelProto:
    """`proto` converted to opset `target`; a one-line error naming the target when a node has no adapter."""
    try:
        lowered = version_converter.convert_version(proto, target)
    except Exception as err:  # the converter raises RuntimeError/ValueError/C++ errors alike
        line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise PipelineError(
            f"export.min_tensorrt: {what} cannot be converted to opset {target}: {line[:200]} "
            f"(try export.exporter = 'legacy', which writes opset {target} directly)"
        ) from None
    if target < 18:
        _drop_noop_attribute(lowered, what, target)
    return lowered


def _drop_noop_attribute(proto: onnx.ModelProto, what: str, target: int) -> None:
    """Remove `noop_with_empty_axes` where it is the default 0; a 1 has no equivalent before opset 18."""
    for node in proto.graph.node:
        if node.op_type not in _REDUCE_GAINED_NOOP_IN_18:
            continue
        kept = [a for a in node.attribute if a.name != "noop_with_empty_axes"]
        if any(a.name == "noop_with_empty_axes" and a.i != 0 for a in node.attribute):
            raise PipelineError(
                f"export.min_tensorrt: {what} uses {node.op_type} with noop_with_empty_axes=1, "
                f"which opset {target} cannot express"
            )
        del node.attribute[:]
        node.attribute.extend(kept)
