"""The parity check on its own: real ONNX Runtime against the PyTorch model, and files it cannot use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import data
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.export.parity import check_parity, save_sample
from pipeline.manifest import RunDir, StageResult
from pipeline.modelfile import load_model
from pipeline.onnx_run import onnx_logits

Exported = tuple[RunDir, StageResult, list[str]]


def _val(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data.val_batch(data.load(Config().data, 0), n)


def test_parity_of_the_exported_file_batches_unevenly(exported: Exported) -> None:
    run, _, _ = exported
    model, _ = load_model(run.path / "model")
    images, labels = _val(23)
    report = check_parity(run.path / "onnx" / "model.onnx", model, images, labels, atol=1e-4, max_batch=5)
    assert report["samples"] == 23
    assert report["passed"] and report["top1_agreement"] == 1.0


def test_a_different_model_fails_parity(exported: Exported) -> None:
    run, _, _ = exported
    model, _ = load_model(run.path / "model")
    with torch.no_grad():
        model[-1].weight.mul_(-1.0)  # flips the ranking of classes: top-1 must disagree somewhere
    images, labels = _val(50)
    report = check_parity(run.path / "onnx" / "model.onnx", model, images, labels, atol=1e-4, max_batch=16)
    assert not report["passed"]
    assert report["top1_agreement"] < 1.0 and report["max_abs_diff"] > 1e-4
    assert report["onnx_accuracy"] != report["torch_accuracy"]


@pytest.mark.parametrize("content", [b"garbage, not protobuf", b"truncated"], ids=["garbage", "truncated"])
def test_corrupt_onnx_file_is_named(exported: Exported, tmp_path: Path, content: bytes) -> None:
    run, _, _ = exported
    model, _ = load_model(run.path / "model")
    good = (run.path / "onnx" / "model.onnx").read_bytes()
    bad = tmp_path / "model.onnx"
    bad.write_bytes(good[: len(good) // 2] if content == b"truncated" else content)
    images, labels = _val(4)
    with pytest.raises(PipelineError, match=f"^{bad}: ONNX Runtime cannot load it"):
        check_parity(bad, model, images, labels, atol=1e-4, max_batch=4)


def test_sample_logits_are_the_onnx_output_for_its_image(exported: Exported, tmp_path: Path) -> None:
    run, _, _ = exported
    onnx_path = run.path / "onnx" / "model.onnx"
    images, labels = _val(3)
    out = tmp_path / "sample.npz"
    save_sample(onnx_path, images[2], int(labels[2]), out)
    sample = np.load(out)
    assert np.array_equal(sample["input"], images[2:3].numpy())
    assert int(sample["label"]) == int(labels[2])
    assert np.array_equal(sample["logits"], onnx_logits(onnx_path, images[2:3].numpy(), 1))
    assert [p.name for p in tmp_path.iterdir()] == ["sample.npz"]
