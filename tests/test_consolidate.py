"""Consolidate stage: real DCP checkpoints written in one process, real safetensors files."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn

from models import build_model
from pipeline import consolidate, data
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir, create_run_dir, read_json, write_json

STEP = 12


def write_checkpoint(run: RunDir, model: nn.Module, step: int = STEP, train_steps: int = 2) -> Path:
    """What the train stage leaves behind: step-N/ (DCP model + optimizer, trainer.json) and `latest` -> step-N.

    A few optimizer steps first give real optimizer state and BatchNorm statistics, not just initial values.
    """
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(train_steps):
        optim.zero_grad()
        model(torch.randn(8, 1, 16, 16)).sum().backward()
        optim.step()
    root = run.path / "train" / "checkpoints"
    step_dir = root / f"step-{step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=step_dir)
    write_json(step_dir / "trainer.json", {"epoch": 1, "step": step})
    latest = root / "latest"
    latest.unlink(missing_ok=True)
    os.symlink(step_dir.name, latest)
    return step_dir


@pytest.fixture
def cfg() -> Config:
    return Config()


@pytest.fixture
def run(cfg: Config, tmp_path: Path) -> RunDir:
    run = create_run_dir(cfg, tmp_path / "run")
    write_json(run.path / "train" / "dataset.json", data.load(cfg.data, cfg.run.seed).info.to_dict())
    write_json(run.path / "train" / "summary.json", {"val_accuracy": 0.875})
    return run


@pytest.fixture
def source(run: RunDir) -> nn.Module:
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 1)
    write_checkpoint(run, model)
    return model.eval()


def test_consolidated_weights_reproduce_the_checkpointed_model(cfg: Config, run: RunDir, source: nn.Module) -> None:
    result = consolidate.run(cfg, run, log=lambda _: None)
    assert result.status == "done"
    assert result.metrics["parameters"] == sum(p.numel() for p in source.parameters())

    model, _ = consolidate.load_model(run.path / "model")
    assert not model.training
    x = torch.randn(5, 1, 16, 16)
    with torch.inference_mode():
        assert torch.equal(model(x), source(x))  # bitwise, not approximately

    with safe_open(str(run.path / result.outputs["weights"]), "pt") as fh:
        assert fh.metadata()["architecture"] == "small_cnn"
        assert fh.metadata()["num_classes"] == "10"
        assert set(fh.keys()) == set(source.state_dict())  # no optimizer state


def test_model_json_describes_input_and_lineage(cfg: Config, run: RunDir, source: nn.Module) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    meta = read_json(run.path / "model" / "model.json")
    info = read_json(run.path / "train" / "dataset.json")
    step_dir = run.path / "train" / "checkpoints" / f"step-{STEP}"
    assert meta["architecture"] == "small_cnn" and meta["num_classes"] == 10
    assert meta["classes"] == info["classes"]
    assert meta["input"] == {
        "layout": "NCHW",
        "dtype": "float32",
        "channels": 1,
        "height": 16,
        "width": 16,
        "mean": info["mean"],
        "std": info["std"],
    }
    assert meta["metrics"] == {"val_accuracy": 0.875}
    lineage = meta["lineage"]
    assert lineage["checkpoint"] == f"step-{STEP}"
    assert lineage["checkpoint_sha256"] == consolidate.checkpoint_sha256(step_dir)
    assert lineage["config_sha256"] == cfg.digest()
    assert len(lineage["source_commit"]) == 40


def test_checkpoint_digest_covers_every_file(run: RunDir, source: nn.Module) -> None:
    step_dir = run.path / "train" / "checkpoints" / f"step-{STEP}"
    before = consolidate.checkpoint_sha256(step_dir)
    write_json(step_dir / "trainer.json", {"epoch": 1, "step": STEP + 1})
    assert consolidate.checkpoint_sha256(step_dir) != before


def test_unchanged_inputs_are_cached(cfg: Config, run: RunDir, source: nn.Module) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    assert consolidate.run(cfg, run, log=lambda _: None).status == "cached"


def _snapshot(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_checkpoint_of_another_architecture_is_refused_and_model_dir_kept(
    cfg: Config, run: RunDir, source: nn.Module
) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    before = _snapshot(run.path / "model")
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": "mobilenet_v3_small"})})
    step_dir = (run.path / "train" / "checkpoints" / "latest").resolve()
    with pytest.raises(PipelineError, match=str(step_dir)) as err:
        consolidate.run(other, run, log=lambda _: None)
    assert "does not fit model.name='mobilenet_v3_small'" in str(err.value)
    assert "missing features.0.0.weight" in str(err.value)
    assert _snapshot(run.path / "model") == before


def test_checkpoint_with_other_class_count_names_the_tensor(cfg: Config, run: RunDir) -> None:
    write_checkpoint(run, build_model("small_cnn", 4, 1))
    with pytest.raises(PipelineError, match=r"5\.weight has shape \[4, 64\], small_cnn expects \[10, 64\]"):
        consolidate.run(cfg, run, log=lambda _: None)
    assert not (run.path / "model").exists()


def test_truncated_shard_is_a_one_line_error(cfg: Config, run: RunDir, source: nn.Module) -> None:
    step_dir = run.path / "train" / "checkpoints" / f"step-{STEP}"
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:64])  # model tensors come first: cut into them, not just the optimizer
    with pytest.raises(PipelineError, match=f"{step_dir}: cannot read checkpoint") as err:
        consolidate.run(cfg, run, log=lambda _: None)
    assert "\n" not in str(err.value)
    assert not (run.path / "model").exists()


def test_non_finite_weights_are_refused(cfg: Config, run: RunDir) -> None:
    model = build_model("small_cnn", 10, 1)
    write_checkpoint(run, model)
    with torch.no_grad():
        model[5].weight[0, 0] = float("nan")
    write_checkpoint(run, model, step=STEP + 1, train_steps=0)
    with pytest.raises(PipelineError, match=r"non-finite values .* in 5\.weight"):
        consolidate.run(cfg, run, log=lambda _: None)


def test_planted_pickle_in_checkpoint_metadata_is_not_run(cfg: Config, run: RunDir, source: nn.Module) -> None:
    marker = run.path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str, str]]:
            return (open, (str(marker), "w"))

    step_dir = run.path / "train" / "checkpoints" / f"step-{STEP}"
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(PipelineError, match=r"refusing to load (builtins|io)\.open"):
        consolidate.run(cfg, run, log=lambda _: None)
    assert not marker.exists()


def test_load_model_names_a_truncated_weights_file(cfg: Config, run: RunDir, source: nn.Module) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    weights = run.path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(PipelineError, match=f"{weights}: cannot read weights"):
        consolidate.load_model(run.path / "model")


def test_load_model_refuses_weights_that_do_not_fit_model_json(cfg: Config, run: RunDir, source: nn.Module) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    meta_path = run.path / "model" / "model.json"
    meta = read_json(meta_path)
    write_json(meta_path, {**meta, "num_classes": 3, "classes": ["a", "b", "c"]})
    with pytest.raises(PipelineError, match=r"model\.safetensors: does not fit small_cnn"):
        consolidate.load_model(run.path / "model")
