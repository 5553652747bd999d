"""What the exported file looks like: a dynamic batch axis, model.json inside, a graph ONNX Runtime runs."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from pipeline.config import ExportConfig
from pipeline.errors import PipelineError
from pipeline.export import onnx_export
from pipeline.files import read_json
from pipeline.manifest import RunDir, StageResult
from pipeline.modelfile import load_model

Exported = tuple[RunDir, StageResult, list[str]]


def test_batch_axis_is_dynamic(exported: Exported) -> None:
    run, _, _ = exported
    model, _ = load_model(run.path / "model")
    session = ort.InferenceSession(str(run.path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, out.name) == ("input", "logits")
    assert isinstance(inp.shape[0], str) and inp.shape[1:] == [1, 16, 16]
    for batch in (1, 7):
        x = torch.randn(batch, 1, 16, 16)
        (logits,) = session.run(None, {"input": x.numpy()})
        assert logits.shape == (batch, 10)
        with torch.inference_mode():
            assert torch.allclose(torch.from_numpy(logits), model(x), atol=1e-4)


def test_metadata_carries_model_json_and_the_batch_profile(exported: Exported) -> None:
    run, _, _ = exported
    meta = onnx_export.read_metadata(run.path / "onnx" / "model.onnx")
    model_json = read_json(run.path / "model" / "model.json")
    assert {k: meta[k] for k in model_json} == model_json
    assert meta["export"] == {
        "opset": 17,
        "batch": {"min": 1, "opt": 4, "max": 16},
        "input": "input",
        "output": "logits",
        "precision": "fp32",
    }


def test_max_batch_of_one_exports_a_static_batch(exported: Exported, tmp_path: Path) -> None:
    run, _, _ = exported
    model, meta = load_model(run.path / "model")
    path = tmp_path / "static.onnx"
    facts = onnx_export.export_onnx(model, meta, ExportConfig(max_batch=1, opt_batch=1), path)
    assert facts["batch"] == {"min": 1, "opt": 1, "max": 1}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 1, 16, 16]


def test_unreadable_file_metadata_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07not a protobuf at all\xff\xff")
    with pytest.raises(PipelineError, match=f"^{bad}: cannot read ONNX metadata"):
        onnx_export.read_metadata(bad)
