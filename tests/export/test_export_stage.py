"""The export stage end to end: real ONNX export, real ONNX Runtime, the parity gate and what it leaves on disk."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import pipeline.export as export_stage
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.export import onnx_export
from pipeline.files import read_json
from pipeline.manifest import RunDir, StageResult

Exported = tuple[RunDir, StageResult, list[str]]


def test_export_passes_the_parity_gate_with_sensible_numbers(exported: Exported) -> None:
    run, result, _ = exported
    assert result.status == "done"
    assert result.outputs == {
        "onnx": "onnx/model.onnx",
        "parity": "onnx/parity.json",
        "sample": "onnx/sample.npz",
        "onnx_fp16": "onnx/model.fp16.onnx",
        "onnx_int8": "onnx/model.int8.onnx",
    }
    assert all((run.path / rel).is_file() for rel in result.outputs.values())
    parity = read_json(run.path / "onnx" / "parity.json")
    assert parity["passed"] is True and parity["all_passed"] is True
    assert parity["samples"] == 100
    assert parity["atol"] == 1e-4
    assert 0.0 <= parity["max_abs_diff"] <= parity["atol"]
    assert parity["top1_agreement"] == 1.0
    assert parity["onnx_accuracy"] == parity["torch_accuracy"] > 0.3  # a (briefly) trained model, not chance (0.1)
    variants = parity["variants"]
    assert result.metrics == {
        "max_abs_diff": parity["max_abs_diff"],
        "top1_agreement": 1.0,
        "onnx_accuracy": parity["onnx_accuracy"],
        "fp32_accuracy": variants["fp32"]["accuracy"],
        "fp16_accuracy": variants["fp16"]["accuracy"],
        "int8_accuracy": variants["int8"]["accuracy"],
        "opset": 17,
    }


def test_every_variant_is_gated_on_the_whole_validation_split(exported: Exported) -> None:
    run, _, _ = exported
    parity = read_json(run.path / "onnx" / "parity.json")
    assert parity["validation_samples"] == 360  # 20% of the 1797 digits, not just the parity images
    assert parity["max_accuracy_drop"] == 0.01
    variants = parity["variants"]
    assert sorted(variants) == ["fp16", "fp32", "int8"]
    fp32 = variants["fp32"]["accuracy"]
    assert fp32 > 0.3
    assert variants["fp32"] == {
        "file": "onnx/model.onnx",
        "accuracy": fp32,
        "drop": 0.0,
        "max_abs_diff": parity["max_abs_diff"],
        "passed": True,
    }
    for name in ("fp16", "int8"):
        entry = variants[name]
        assert entry["file"] == f"onnx/model.{name}.onnx" and entry["passed"] is True
        assert entry["drop"] == pytest.approx(fp32 - entry["accuracy"]) and entry["drop"] <= 0.01
    # fp16 rounds logits a little; int8 visibly, but both keep the answers.
    assert 0.0 < variants["fp16"]["max_abs_diff"] < 1e-2 < variants["int8"]["max_abs_diff"]


def test_opset_is_lowered_to_what_the_oldest_tensorrt_parses(exported: Exported) -> None:
    run, result, lines = exported
    assert result.metrics["opset"] == 17
    assert onnx_export.read_metadata(run.path / "onnx" / "model.onnx")["export"]["opset"] == 17
    choice = read_json(run.path / "onnx" / "parity.json")["opset"]
    assert choice == {
        "opset": 17,
        "exported": 18,
        "exporter": "dynamo",
        "min_tensorrt": "8.5",
        "reason": "TensorRT 8.5 (export.min_tensorrt) parses up to opset 17; the exporter wrote 18, converted down",
    }
    assert any("opset 17: TensorRT 8.5" in line for line in lines)


def test_unchanged_inputs_are_cached(exported: Exported, make_config: Callable[..., Config]) -> None:
    run, result, _ = exported
    again = export_stage.run(make_config(), run, log=lambda _: None)
    assert again.status == "cached"
    assert again.metrics == result.metrics


def _perturbed_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Export a model whose logits are all shifted by 1.0, so ONNX and PyTorch differ for certain."""
    real = onnx_export.export_onnx

    def export_shifted(model: nn.Module, *args: object) -> dict[str, object]:
        shifted = copy.deepcopy(model)
        with torch.no_grad():
            shifted[-1].bias += 1.0
        return real(shifted, *args)

    monkeypatch.setattr(export_stage, "export_onnx", export_shifted)


def test_failed_parity_gate_keeps_evidence_but_writes_no_model(
    monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    cfg = make_config()
    run = make_run(cfg)
    leftover = run.path / "onnx" / ".staging-99999"  # what an export killed mid-way leaves
    leftover.mkdir(parents=True)
    (leftover / "model.onnx").write_bytes(b"half a file")
    _perturbed_export(monkeypatch)
    with pytest.raises(PipelineError, match=r"parity\.json: fp32 parity gate failed: max_abs_diff 1 \(atol 0\.0001\)"):
        export_stage.run(cfg, run, log=lambda _: None)
    parity = read_json(run.path / "onnx" / "parity.json")
    assert parity["passed"] is False and parity["all_passed"] is False
    assert parity["max_abs_diff"] == pytest.approx(1.0, abs=1e-4)
    assert parity["variants"]["fp32"]["passed"] is False
    # No model, no staging directory: neither this run's nor the one a killed export left.
    assert sorted(p.name for p in (run.path / "onnx").iterdir()) == ["parity.json"]
    assert "export" not in run.manifest()["stages"]


def test_failed_parity_gate_leaves_the_earlier_model_in_place(
    monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    cfg = make_config()
    run = make_run(cfg, with_onnx=True)
    names = ("model.onnx", "model.fp16.onnx", "model.int8.onnx", "sample.npz")
    before = {name: (run.path / "onnx" / name).read_bytes() for name in names}
    _perturbed_export(monkeypatch)
    with pytest.raises(PipelineError, match="parity gate failed"):
        export_stage.run(cfg, run, log=lambda _: None)
    assert {name: (run.path / "onnx" / name).read_bytes() for name in before} == before
    assert not read_json(run.path / "onnx" / "parity.json")["passed"]


def test_images_of_another_size_than_the_model_are_refused(
    make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    cfg = make_config(image_size=24)
    run = make_run(cfg)
    with pytest.raises(PipelineError, match=r"data\.image_size: validation images are 24x24, .* trained on 16x16"):
        export_stage.run(cfg, run, log=lambda _: None)
    assert not (run.path / "onnx").exists()


def test_a_model_the_exporter_cannot_handle_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)[:, :10] if x.sum() > 0 else -x.flatten(1)[:, :10]

    cfg = make_config()
    run = make_run(cfg)
    real_load = export_stage.load_model
    monkeypatch.setattr(export_stage, "load_model", lambda path: (DataDependent(), real_load(path)[1]))
    with pytest.raises(PipelineError, match=r"^export: small_cnn could not be exported: ") as err:
        export_stage.run(cfg, run, log=lambda _: None)
    assert "\n" not in str(err.value)
    assert not (run.path / "onnx" / "model.onnx").exists()
    assert [p.name for p in (run.path / "onnx").iterdir()] == []  # the staging directory is gone too


def test_sample_holds_a_real_validation_image_and_its_onnx_logits(exported: Exported) -> None:
    run, _, _ = exported
    sample = np.load(run.path / "onnx" / "sample.npz")
    assert sample["input"].shape == (1, 1, 16, 16) and sample["input"].dtype == np.float32
    assert sample["logits"].shape == (1, 10)
    assert 0 <= int(sample["label"]) < 10
    assert float(np.abs(sample["input"]).max()) > 0.5  # normalised pixels, not zeros
