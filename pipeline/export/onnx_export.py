"""ONNX export with a dynamic batch axis; model.json travels inside the file as metadata."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import onnxscript.optimizer
import torch
from google.protobuf.message import DecodeError
from torch import nn

from pipeline.config import ExportConfig
from pipeline.errors import PipelineError
from pipeline.export import opset
from pipeline.files import first_line

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
EXPORT_KEY = "export"
"""metadata_props key holding {opset, batch: {min, opt, max}, input, output, precision}; the other keys mirror
model.json."""
_CHATTY_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Mute the exporter: its progress lines, opset notices and graph dumps on failure are noise on screen."""
    levels = {name: logging.getLogger(name).level for name in _CHATTY_LOGGERS}
    sink = io.StringIO()
    try:
        for name in _CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _reason(err: BaseException) -> str:
    """The exporter's own first line is generic ("Failed to export ..."); its cause says what went wrong."""
    cause = err.__cause__
    text = first_line(err)
    return f"{text} ({type(cause).__name__}: {first_line(cause)[:200]})" if cause else text


def input_shape(meta: dict[str, Any]) -> tuple[int, int, int]:
    """(C, H, W) of one input image, from model.json."""
    spec = meta["input"]
    return int(spec["channels"]), int(spec["height"]), int(spec["width"])


def written_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset the file declares (the dynamo exporter raises requests below 18 to 18)."""
    return next(op.version for op in proto.opset_import if op.domain in ("", "ai.onnx"))


def _torch_export(model: nn.Module, example: torch.Tensor, cfg: ExportConfig, path: Path, target: int) -> None:
    """Write `model` to `path`; the dynamo exporter writes at least opset 18, the legacy one `target` itself."""
    dynamo = cfg.exporter == "dynamo"
    if cfg.max_batch == 1:  # torch.export cannot make an axis dynamic when min == max: a static batch
        shapes: dict[str, Any] = {}
    elif dynamo:
        shapes = {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=cfg.max_batch)},)}
    else:
        shapes = {"dynamic_axes": {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}}
    with quiet():
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=dynamo,
            external_data=False,  # one self-contained file: what TensorRT and the device get
            opset_version=max(target, 18) if dynamo else target,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            verbose=False,
            **shapes,
        )


def _simplify(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """onnxscript's optimizer (constant folding, dead-code and identity removal); node counts before and after."""
    with quiet():
        simplified = onnxscript.optimizer.optimize(proto)
    return simplified, {"nodes_before": len(proto.graph.node), "nodes_after": len(simplified.graph.node)}


def export_onnx(model: nn.Module, meta: dict[str, Any], cfg: ExportConfig, path: Path) -> dict[str, Any]:
    """Export `model` to `path` with batch 1..max_batch, check the graph, embed `meta`; return the export facts.

    The opset is the lower of `export.opset` and what TensorRT `export.min_tensorrt` parses; a file written at a
    newer opset is converted down. The facts ({opset, batch: {min, opt, max}, input, output, precision}) are stored
    under the `export` metadata key, so the file describes itself to whoever inspects it (the build stage sizes
    its profiles from the `export` config); the returned dict adds how the opset was chosen (`opset_choice`) and,
    with `export.simplify`, the node counts.
    """
    arch = meta["architecture"]
    target, why = opset.choose(cfg.min_tensorrt, cfg.opset)
    example = torch.zeros(min(2, cfg.max_batch), *input_shape(meta))
    try:
        _torch_export(model, example, cfg, path, target)
    except Exception as err:  # the exporter raises many unrelated types; each means "this model cannot be exported"
        raise PipelineError(f"export: {arch} could not be exported: {_reason(err)}") from err
    proto = onnx.load(str(path))
    written = written_opset(proto)
    choice = {"opset": target, "exported": written, "exporter": cfg.exporter, "min_tensorrt": cfg.min_tensorrt}
    if written > target:
        proto = opset.lower(proto, target, f"{arch} (exported at opset {written})")
        why += f"; the exporter wrote {written}, converted down"
    elif written < target:
        target, why = written, why + f"; the exporter wrote {written}"
    extra: dict[str, Any] = {"opset_choice": {**choice, "opset": target, "reason": why}}
    if cfg.simplify:
        proto, extra["simplified"] = _simplify(proto)
    facts = {
        "opset": target,
        "batch": {"min": 1, "opt": cfg.opt_batch, "max": cfg.max_batch},
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
        "precision": "fp32",
    }
    del proto.metadata_props[:]
    props = {key: json.dumps(value) for key, value in meta.items()}
    onnx.helper.set_model_props(proto, {**props, EXPORT_KEY: json.dumps(facts)})
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as err:
        reason = first_line(err)
        raise PipelineError(f"export: {arch} exported to an invalid graph at opset {target}: {reason}") from err
    onnx.save(proto, str(path))
    return {**facts, **extra}


def read_metadata(path: Path) -> dict[str, Any]:
    """The JSON metadata an exported file carries: model.json's keys plus `export`."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
        return {prop.key: json.loads(prop.value) for prop in proto.metadata_props}
    except (OSError, DecodeError, json.JSONDecodeError) as err:
        raise PipelineError(f"{path}: cannot read ONNX metadata: {first_line(err)}") from None
