"""Fixtures shared across test packages."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from models import build_model


def export_small_cnn(path: Path) -> Path:
    """small_cnn (10 classes, 1x16x16) exported as the export stage does it: dynamic batch, input/logits, one file.

    Shared through the session's base temp dir, so build and deploy tests pay for one export (~3 s).
    """
    if path.exists():
        return path
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 1).eval()
    batch = torch.export.Dim("batch", min=1, max=32)
    raw = path.with_name(f"raw-{path.name}")
    torch.onnx.export(
        model,
        (torch.randn(2, 1, 16, 16),),
        str(raw),
        dynamo=True,
        dynamic_shapes=({0: batch},),
        input_names=["input"],
        output_names=["logits"],
    )
    onnx.save(onnx.load(str(raw)), str(path))  # the exporter may put weights in raw.onnx.data: embed them
    return path


@pytest.fixture(scope="session")
def small_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported model (once per session)."""
    return export_small_cnn(tmp_path_factory.getbasetemp() / "small_cnn.onnx")
