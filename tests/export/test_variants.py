"""fp16 and int8 variants, the accuracy gate, the opset chosen per TensorRT target and graph simplification."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from safetensors.torch import load_file, save_file

import pipeline.export as export_stage
from pipeline.config import Config, load_config
from pipeline.errors import PipelineError
from pipeline.export import onnx_export, opset
from pipeline.files import read_json
from pipeline.manifest import RunDir, StageResult
from pipeline.modelfile import load_model

Exported = tuple[RunDir, StageResult, list[str]]


@pytest.mark.parametrize("variant", ["fp16", "int8"])
def test_variant_runs_in_onnx_runtime_with_a_dynamic_batch_and_fp32_io(exported: Exported, variant: str) -> None:
    run, _, _ = exported
    path = run.path / "onnx" / f"model.{variant}.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, out.name, out.type) == ("input", "tensor(float)", "logits", "tensor(float)")
    assert isinstance(inp.shape[0], str)
    for batch in (1, 7):
        (logits,) = session.run(None, {"input": np.random.default_rng(batch).standard_normal((batch, 1, 16, 16), "f")})
        assert logits.shape == (batch, 10) and logits.dtype == np.float32
    meta = onnx_export.read_metadata(path)
    assert meta["export"]["precision"] == variant and meta["export"]["opset"] == 17
    assert meta["architecture"] == "small_cnn"


def test_fp16_graph_holds_half_precision_weights(exported: Exported) -> None:
    run, _, _ = exported
    proto = onnx.load(str(run.path / "onnx" / "model.fp16.onnx"))
    weights = [init for init in proto.graph.initializer if len(init.dims) == 4]
    assert weights and all(init.data_type == onnx.TensorProto.FLOAT16 for init in weights)


def test_int8_graph_is_explicit_symmetric_qdq_with_per_channel_weights(exported: Exported) -> None:
    run, _, _ = exported
    proto = onnx.load(str(run.path / "onnx" / "model.int8.onnx"))
    init = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    quant = [n for n in proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert {n.op_type for n in quant} == {"QuantizeLinear", "DequantizeLinear"}
    zero_points = [init[n.input[2]] for n in quant if len(n.input) > 2]
    assert zero_points and all(zp.dtype == np.int8 and not zp.any() for zp in zero_points)  # symmetric: all 0
    conv_weights = {n.input[1] for n in proto.graph.node if n.op_type == "Conv"}
    weight_dq = [n for n in quant if n.op_type == "DequantizeLinear" and n.output[0] in conv_weights]
    assert weight_dq and all(init[n.input[1]].ndim == 1 and init[n.input[1]].size > 1 for n in weight_dq)


def _plant_outlier_channel(run: RunDir) -> None:
    """Make channel 0 of the first block ~1e4 after ReLU while the next conv ignores it: same fp32 function.

    One per-tensor activation scale must then cover 1e4, so every other channel rounds to 0 in int8: the
    accuracy of the int8 file collapses for real, as with outlier activations in practice.
    """
    weights = run.path / "model" / "model.safetensors"
    state = load_file(str(weights))
    state["0.1.bias"][0] = 1e4
    state["2.0.weight"][:, 0] = 0.0
    save_file(state, str(weights), metadata={"format": "pt"})


def test_int8_accuracy_collapse_fails_the_gate_and_promotes_nothing(
    make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    cfg = make_config()
    run = make_run(cfg, with_onnx=True)
    names = ("model.onnx", "model.fp16.onnx", "model.int8.onnx", "sample.npz")
    before = {name: (run.path / "onnx" / name).read_bytes() for name in names}
    _plant_outlier_channel(run)
    gate = r"parity\.json: accuracy gate failed on 360 validation images: int8 "
    with pytest.raises(PipelineError, match=gate) as err:
        export_stage.run(cfg, run, log=lambda _: None)
    assert "fp16" not in str(err.value) and "export.max_accuracy_drop 0.01" in str(err.value)
    parity = read_json(run.path / "onnx" / "parity.json")
    assert parity["passed"] is True and parity["all_passed"] is False  # fp32 parity held, int8 did not
    int8, fp32 = parity["variants"]["int8"], parity["variants"]["fp32"]
    assert int8["passed"] is False and int8["accuracy"] < 0.2 < fp32["accuracy"]  # ~chance for 10 classes
    assert int8["drop"] == pytest.approx(fp32["accuracy"] - int8["accuracy"])
    assert int8["drop"] > 0.01
    assert f"int8 accuracy {int8['accuracy']:.4f} vs fp32 {fp32['accuracy']:.4f}" in str(err.value)
    assert parity["variants"]["fp16"]["passed"] is True
    assert {name: (run.path / "onnx" / name).read_bytes() for name in names} == before
    assert sorted(p.name for p in (run.path / "onnx").iterdir()) == sorted([*names, "parity.json"])


def test_legacy_exporter_with_simplification_writes_the_target_opset(
    make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    cfg = make_config({"exporter": "legacy", "simplify": True, "variants": ["fp32"], "min_tensorrt": "8.6"})
    run = make_run(cfg, with_onnx=True)
    result = export_stage.run(cfg, run, log=lambda _: None)
    parity = read_json(run.path / "onnx" / "parity.json")
    assert result.metrics["opset"] == 17 and parity["opset"]["exported"] == 17  # written directly, not converted
    assert parity["passed"] and list(parity["variants"]) == ["fp32"]
    assert parity["simplified"]["nodes_after"] <= parity["simplified"]["nodes_before"]
    # variant files of the earlier run were not made by this one: they must not linger as if current
    assert not (run.path / "onnx" / "model.int8.onnx").exists()
    assert not (run.path / "onnx" / "model.fp16.onnx").exists()


def test_a_newer_tensorrt_keeps_the_exporters_opset(exported: Exported, tmp_path: Path) -> None:
    run, _, _ = exported
    model, meta = load_model(run.path / "model")
    cfg = Config.model_validate({"export": {"min_tensorrt": "10.3", "max_batch": 4, "opt_batch": 2}}).export
    facts = onnx_export.export_onnx(model, meta, cfg, tmp_path / "m.onnx")
    assert facts["opset"] == 18 and facts["opset_choice"]["exported"] == 18
    assert onnx_export.written_opset(onnx.load(str(tmp_path / "m.onnx"))) == 18


@pytest.mark.parametrize(
    ("version", "requested", "expected"),
    [("8.5", 18, 17), ("8.6", 21, 17), ("10.3", 21, 20), ("10.3", 18, 18), ("11.1", 23, 23), ("8.2", 18, 13)],
)
def test_opset_choice_per_tensorrt(version: str, requested: int, expected: int) -> None:
    assert opset.choose(version, requested)[0] == expected


def test_tensorrt_older_than_the_table_is_refused() -> None:
    with pytest.raises(PipelineError, match=r"^export\.min_tensorrt: TensorRT 7\.2 is older"):
        opset.tensorrt_max_opset("7.2")


def test_min_tensorrt_must_be_major_minor() -> None:
    with pytest.raises(PipelineError, match=r"export\.min_tensorrt"):
        load_config(None, ['export.min_tensorrt="jetpack5"'])


def _reduce_mean_model(noop: int) -> onnx.ModelProto:
    node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1, noop_with_empty_axes=noop)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_lowering_fixes_the_converters_reduce_attribute_and_stays_exact() -> None:
    lowered = opset.lower(_reduce_mean_model(0), 17, "m")
    onnx.checker.check_model(lowered, full_check=True)  # the plain converter output fails this check
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.allclose(session.run(None, {"x": x})[0], x.mean(1, keepdims=True))


def test_lowering_that_cannot_be_expressed_names_the_target() -> None:
    with pytest.raises(PipelineError, match=r"^export\.min_tensorrt: m uses ReduceMean .* opset 17 cannot express"):
        opset.lower(_reduce_mean_model(1), 17, "m")


def test_converter_failure_names_the_target_and_the_fallback() -> None:
    model = _reduce_mean_model(0)
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(PipelineError, match=r"cannot be converted to opset 13: .*export\.exporter = 'legacy'"):
        opset.lower(model, 13, "m")


def test_export_config_defaults_keep_the_quickstart_fast() -> None:
    cfg = Config().export
    assert cfg.variants == ["fp32"] and cfg.max_accuracy_drop == 0.01 and cfg.min_tensorrt == "8.5"
    assert cfg.exporter == "dynamo" and cfg.simplify is False


def test_fp16_logits_stay_within_nvidias_fp16_tolerance_of_pytorch(exported: Exported) -> None:
    run, _, _ = exported
    model, _ = load_model(run.path / "model")
    x = torch.randn(3, 1, 16, 16)
    session = ort.InferenceSession(str(run.path / "onnx" / "model.fp16.onnx"), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        ref = model(x).numpy()
    assert np.abs(session.run(None, {"input": x.numpy()})[0] - ref).max() < 1e-2
