"""ONNX export with a dynamic batch axis; model.json travels inside the file as metadata."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import torch
from google.protobuf.message import DecodeError
from torch import nn

from pipeline.config import ExportConfig
from pipeline.errors import PipelineError

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
EXPORT_KEY = "export"
"""metadata_props key holding {opset, batch: {min, opt, max}, input, output}; the other keys mirror model.json."""
_CHATTY_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _reason(err: BaseException) -> str:
    """The exporter's own first line is generic ("Failed to export ..."); its cause says what went wrong."""
    cause = err.__cause__
    text = _first_line(err)
    return f"{text} ({type(cause).__name__}: {_first_line(cause)[:200]})" if cause else text


def input_shape(meta: dict[str, Any]) -> tuple[int, int, int]:
    """(C, H, W) of one input image, from model.json."""
    spec = meta["input"]
    return int(spec["channels"]), int(spec["height"]), int(spec["width"])


def written_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset the file declares (the dynamo exporter raises requests below 18 to 18)."""
    return next(op.version for op in proto.opset_import if op.domain in ("", "ai.onnx"))


def export_onnx(model: nn.Module, meta: dict[str, Any], cfg: ExportConfig, path: Path) -> dict[str, Any]:
    """Export `model` to `path` with batch 1..max_batch, check the graph, embed `meta`; return the export facts.

    The facts ({opset, batch: {min, opt, max}, input, output}) are also stored under the `export` metadata key, so
    the build stage can size TensorRT profiles from the file alone.
    """
    example = torch.zeros(min(2, cfg.max_batch), *input_shape(meta))
    # torch.export cannot make an axis dynamic when min == max: a max_batch of 1 is a static batch.
    dynamic = ({0: torch.export.Dim("batch", min=1, max=cfg.max_batch)},) if cfg.max_batch > 1 else None
    try:
        with _quiet():
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                external_data=False,  # one self-contained file: what TensorRT and the device get
                opset_version=cfg.opset,
                dynamic_shapes=dynamic,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                verbose=False,
            )
    except Exception as err:  # the exporter raises many unrelated types; each means "this model cannot be exported"
        raise PipelineError(f"export: {meta['architecture']} could not be exported: {_reason(err)}") from err
    proto = onnx.load(str(path))
    facts = {
        "opset": written_opset(proto),
        "batch": {"min": 1, "opt": cfg.opt_batch, "max": cfg.max_batch},
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
    }
    props = {key: json.dumps(value) for key, value in meta.items()}
    onnx.helper.set_model_props(proto, {**props, EXPORT_KEY: json.dumps(facts)})
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as err:
        raise PipelineError(f"export: {meta['architecture']} exported to an invalid graph: {_first_line(err)}") from err
    onnx.save(proto, str(path))
    return facts


def read_metadata(path: Path) -> dict[str, Any]:
    """The JSON metadata an exported file carries: model.json's keys plus `export`."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
        return {prop.key: json.loads(prop.value) for prop in proto.metadata_props}
    except (OSError, DecodeError, json.JSONDecodeError) as err:
        raise PipelineError(f"{path}: cannot read ONNX metadata: {_first_line(err)}") from None
