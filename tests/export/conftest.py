"""A briefly trained small CNN, checkpointed with DCP and consolidated, then exported once for the whole session."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader

from models import build_model
from pipeline import consolidate, data, export
from pipeline.config import Config
from pipeline.files import write_json
from pipeline.manifest import RunDir, StageResult, create_run_dir

EXPORT = {
    "opset": 18,
    "max_batch": 16,
    "opt_batch": 4,
    "parity_samples": 100,
    "atol": 1e-4,
    "variants": ["fp32", "fp16", "int8"],
    "calibration_samples": 64,
}
"""Every variant, built once per session; TensorRT 8.5 (the default `min_tensorrt`) lowers opset 18 to 17."""


def export_config(export: dict[str, object] | None = None, **data_overrides: object) -> Config:
    """The quickstart config with small export numbers: parity spans several batches of at most max_batch."""
    return Config.model_validate({"export": {**EXPORT, **(export or {})}, "data": data_overrides})


def _write_trained_checkpoint(cfg: Config, run: RunDir) -> None:
    """20 steps on the real digits (accuracy ~0.5, well above chance), saved as the train stage saves them."""
    splits = data.load(cfg.data, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.name, len(splits.info.classes), splits.info.channels)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(DataLoader(splits.train, batch_size=64, shuffle=True)):
        if step == 20:
            break
        optim.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optim.step()
    step_dir = run.path / "train" / "checkpoints" / "step-20"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves in a single process: it does
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=step_dir)
    write_json(step_dir / "trainer.json", {"epoch": 1, "step": 20})
    os.symlink(step_dir.name, step_dir.parent / "latest")
    write_json(run.path / "train" / "dataset.json", splits.info.to_dict())
    write_json(run.path / "train" / "summary.json", {"val_accuracy": 0.9})


@pytest.fixture(scope="session")
def consolidated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir holding train/ (DCP checkpoint, dataset.json, summary.json) and the consolidated model/."""
    cfg = export_config()
    run = create_run_dir(cfg, tmp_path_factory.mktemp("consolidated") / "run")
    _write_trained_checkpoint(cfg, run)
    consolidate.run(cfg, run, log=lambda _: None)
    return run.path


def _new_run(source: Path, dest: Path, cfg: Config, with_onnx: bool = False) -> RunDir:
    """A fresh run dir with a copy of `source`'s model/ (and, when asked, of its onnx/)."""
    run = create_run_dir(cfg, dest)
    shutil.copytree(source / "model", run.path / "model")
    if with_onnx:
        shutil.copytree(source / "onnx", run.path / "onnx")
    return run


@pytest.fixture(scope="session")
def exported(consolidated: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, StageResult, list[str]]:
    """The export stage run once on the consolidated model: (run dir, its result, the lines it logged)."""
    cfg = export_config()
    run = _new_run(consolidated, tmp_path_factory.mktemp("exported") / "run", cfg)
    lines: list[str] = []
    return run, export.run(cfg, run, log=lines.append), lines


@pytest.fixture
def make_config() -> Callable[..., Config]:
    """`export_config` for tests: `make_config({"simplify": True}, image_size=24)` overrides export and data keys."""
    return export_config


@pytest.fixture
def make_run(
    consolidated: Path, exported: tuple[RunDir, StageResult, list[str]], tmp_path: Path
) -> Callable[..., RunDir]:
    """`make_run(cfg, with_onnx=False)`: a fresh run dir holding the consolidated model/ (and the exported onnx/)."""

    def make(cfg: Config, with_onnx: bool = False) -> RunDir:
        source = exported[0].path if with_onnx else consolidated
        return _new_run(source, tmp_path / "run", cfg, with_onnx)

    return make
