"""Run directories holding what the export stage hands to deploy: a real ONNX export, its sample, model.json."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from pipeline.config import Config, DeployConfig, LocalTarget
from pipeline.manifest import RunDir, create_run_dir

CLASSES = [f"digit-{i}" for i in range(10)]


def variant(src: Path, dest: Path, scale: float) -> Path:
    """A second, genuinely different model: the same graph with the last bias shifted (a new sha256, new logits)."""
    model = onnx.load(str(src))
    bias = next(t for t in reversed(model.graph.initializer) if t.name.endswith(".bias"))
    shifted = numpy_helper.to_array(bias) + np.float32(scale)
    bias.CopyFrom(numpy_helper.from_array(shifted, bias.name))
    onnx.save(model, str(dest))
    return dest


@pytest.fixture(scope="session")
def onnx_models(tmp_path_factory: pytest.TempPathFactory, small_onnx: Path) -> list[Path]:
    """Two different real ONNX models (exported once per session)."""
    return [small_onnx, variant(small_onnx, tmp_path_factory.mktemp("onnx") / "variant.onnx", 0.25)]


def ort_logits(model: Path, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime's output for `x`, as the export stage stores it in sample.npz."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input": x})[0]


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., RunDir]:
    """make_run(run_id, onnx, wrong_answer=False): a run dir with onnx/model.onnx, onnx/sample.npz, model/model.json.

    `wrong_answer` stores logits whose argmax the model does not give, so the release fails its health check.
    """

    def make(run_id: str, model: Path, wrong_answer: bool = False) -> RunDir:
        run = create_run_dir(Config(), tmp_path / "runs" / run_id)
        (run.path / "onnx").mkdir()
        (run.path / "model").mkdir()
        shutil.copyfile(model, run.path / "onnx/model.onnx")
        x = np.random.default_rng(7).standard_normal((1, 1, 16, 16)).astype(np.float32)
        stored = ort_logits(model, x)
        if wrong_answer:
            stored[0, stored.argmax()] = stored.min() - 1.0
        np.savez(run.path / "onnx/sample.npz", input=x, label=np.int64(3), logits=stored)
        meta = {"architecture": "small_cnn", "classes": CLASSES, "input": {"channels": 1, "image_size": 16}}
        (run.path / "model/model.json").write_text(json.dumps(meta))
        return run

    return make


@pytest.fixture
def deploy_cfg(tmp_path: Path) -> Callable[..., Config]:
    """deploy_cfg(keep=3, extra=[]): a config with one local target at tmp_path/device (plus `extra` targets)."""

    def make(keep: int = 3, extra: list[LocalTarget] | None = None) -> Config:
        targets = [LocalTarget(name="local", root=tmp_path / "device"), *(extra or [])]
        return Config(deploy=DeployConfig(targets=targets, keep_releases=keep))

    return make
