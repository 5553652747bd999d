"""Precision variants of the fp32 ONNX file, in the forms TensorRT consumes without builder precision flags.

fp16: an FP16 graph whose inputs and outputs stay fp32 (Casts at the edges), what TensorRT 11's strongly typed
builds need. int8: explicit QuantizeLinear/DequantizeLinear pairs, symmetric int8 activations and per-channel
symmetric int8 weights, calibrated on real training images (ONNX Runtime's quantization tools, MinMax ranges).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnxconverter_common import float16
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from pipeline.errors import PipelineError
from pipeline.export.onnx_export import EXPORT_KEY, INPUT_NAME, quiet

VARIANTS = ("fp16", "int8")
"""Variants derived from model.onnx, in the order they are built."""


class _Batches(CalibrationDataReader):
    """Feeds calibration batches to ONNX Runtime's calibrator, one `{input: array}` at a time."""

    def __init__(self, batches: list[np.ndarray]) -> None:
        self._items = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next batch, or None when the calibration set is used up."""
        batch = next(self._items, None)
        return None if batch is None else {INPUT_NAME: batch}


def _stamp(proto: onnx.ModelProto, metadata: dict[str, str], precision: str) -> None:
    """Carry model.json and the export facts over, with the variant's precision added."""
    facts = {**json.loads(metadata[EXPORT_KEY]), "precision": precision}
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, {**metadata, EXPORT_KEY: json.dumps(facts)})


def _metadata(proto: onnx.ModelProto) -> dict[str, str]:
    return {prop.key: prop.value for prop in proto.metadata_props}


def to_fp16(source: Path, dest: Path) -> None:
    """Write an FP16 copy of `source` with fp32 inputs and outputs to `dest`."""
    proto = onnx.load(str(source))
    metadata = _metadata(proto)
    with quiet():
        half = float16.convert_float_to_float16(proto, keep_io_types=True)
    _stamp(half, metadata, "fp16")
    _check_and_save(half, dest, "fp16")


@contextlib.contextmanager
def _quiet_root() -> Iterator[None]:
    """onnxruntime.quantization warns through the root logger (pre-processing advice): not for the user's screen."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def to_int8(source: Path, dest: Path, calibration: list[np.ndarray]) -> None:
    """Write a Q/DQ int8 copy of `source` to `dest`, activation ranges calibrated on the `calibration` batches."""
    metadata = _metadata(onnx.load(str(source), load_external_data=False))
    with _quiet_root(), quiet():
        quantize_static(
            str(source),
            str(dest),
            _Batches(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            # TensorRT takes zero points of 0 only (symmetric ranges), and int8 Q/DQ only: biases stay fp32 for it
            # to fuse, as an int32 DequantizeLinear does not parse on TensorRT 8.x.
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False},
        )
    proto = onnx.load(str(dest))
    _stamp(proto, metadata, "int8")
    _check_and_save(proto, dest, "int8")


def _check_and_save(proto: onnx.ModelProto, dest: Path, variant: str) -> None:
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as err:
        first = (str(err).strip().splitlines() or ["invalid"])[0]
        raise PipelineError(f"export.variants: the {variant} graph is invalid: {first}") from err
    onnx.save(proto, str(dest))
