"""Consolidate stage: real DCP checkpoints written in one process, real safetensors files."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from models import build_model
from pipeline import consolidate, data, modelfile
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.files import read_json, write_json
from pipeline.manifest import RunDir, create_run_dir
from tests.durability import publishes, strace, unsynced_publishes

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

    model, _ = modelfile.load_model(run.path / "model")
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
        "normalization": "dataset",  # the training split's own statistics: digits, from scratch
    }
    assert meta["metrics"] == {"val_accuracy": 0.875}
    lineage = meta["lineage"]
    assert lineage["checkpoint"] == f"step-{STEP}"
    assert lineage["checkpoint_sha256"] == consolidate.checkpoint_sha256(step_dir)
    assert lineage["config_sha256"] == cfg.digest()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", lineage["source_commit"])  # dirty: built from uncommitted code


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
        modelfile.load_model(run.path / "model")


def test_load_model_refuses_weights_that_do_not_fit_model_json(cfg: Config, run: RunDir, source: nn.Module) -> None:
    consolidate.run(cfg, run, log=lambda _: None)
    meta_path = run.path / "model" / "model.json"
    meta = read_json(meta_path)
    write_json(meta_path, {**meta, "num_classes": 3, "classes": ["a", "b", "c"]})
    with pytest.raises(PipelineError, match=r"model\.safetensors: does not fit small_cnn"):
        modelfile.load_model(run.path / "model")


_SHARDED_WRITER = """
import os, sys, warnings
from pathlib import Path
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from models import build_model


def rank(r, world, strategy, step_dir, init):
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=r, world_size=world)
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 1)
    if strategy == "fsdp":
        for block in (model[0], model[2]):
            fully_shard(block, mesh=None)
        model = fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The same data on every rank: BatchNorm buffers are per-rank replicas, and DCP may keep any rank's copy.
    torch.manual_seed(1)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(8, 1, 16, 16)).sum().backward()
        optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=step_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if r == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(step_dir).parent / "reference.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    world, strategy, step_dir, rendezvous = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    init = "file://" + rendezvous
    mp.spawn(rank, args=(world, strategy, step_dir, init), nprocs=world)
"""


@pytest.mark.slow  # ~35 s per case on 2 busy cores: spawning ranks dominates
@pytest.mark.parametrize(("strategy", "world"), [("fsdp", 2), ("ddp", 2), ("fsdp", 3)])
def test_sharded_checkpoint_from_any_world_size_merges_into_one_model(
    cfg: Config, run: RunDir, tmp_path: Path, strategy: str, world: int
) -> None:
    root = run.path / "train" / "checkpoints"
    step_dir = root / "step-7"
    script = tmp_path / "write_sharded.py"
    script.write_text(_SHARDED_WRITER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, str(script), str(world), strategy, str(step_dir), str(tmp_path / "rendezvous")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(step_dir.glob("*.distcp"))) == world  # one shard per rank
    os.symlink(step_dir.name, root / "latest")
    result = consolidate.run(cfg, run, log=lambda _: None)
    assert result.metrics["checkpoint"] == "step-7"
    merged = load_file(str(run.path / "model" / "model.safetensors"))
    reference = load_file(str(root / "reference.safetensors"))
    assert set(merged) == set(reference)  # every tensor, no optimizer state
    assert all(torch.equal(merged[k], reference[k]) for k in reference)


_PEAK_MEMORY = """
import json, os, sys, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from models import MODELS
from models.registry import ModelSpec
from pipeline import consolidate
from pipeline.config import Config
from pipeline.manifest import RunDir, create_run_dir
from pipeline.files import write_json


def wide_mlp(num_classes, in_channels):
    hidden = [nn.Linear(2048, 2048) for _ in range(6)]
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 256, 2048), *hidden, nn.Linear(2048, num_classes))


def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


MODELS["wide_mlp"] = ModelSpec(wide_mlp, channels=None, min_size=8, head="8.")
mode, root = sys.argv[1], Path(sys.argv[2])
cfg = Config.model_validate({"model": {"name": "wide_mlp"}})
if mode == "write":
    create_run_dir(cfg, root)
    model = wide_mlp(10, 1)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 16, 16)).sum().backward()
    optim.step()
    step = root / "train" / "checkpoints" / "step-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=step)
    os.symlink("step-1", step.parent / "latest")
    info = {"classes": [str(i) for i in range(10)], "channels": 1, "image_size": 16, "mean": [0.0], "std": [1.0]}
    write_json(root / "train" / "dataset.json", info)
    write_json(root / "train" / "summary.json", {"val_accuracy": 0.5})
else:
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    consolidate.run(cfg, RunDir(root), log=lambda _: None)
    weights = (root / "model" / "model.safetensors").stat().st_size
    print(json.dumps({"before": before, "peak": status("VmHWM"), "weights": weights}))
"""


@pytest.mark.slow
def test_peak_memory_stays_within_twice_the_weights(tmp_path: Path) -> None:
    """A 103 MB model (checkpoint with AdamW state: ~310 MB) consolidates with at most 2x its size of extra memory.

    What remains above 1x is DCP reading one tensor at a time (its bytes and the tensor made from them).
    """
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_MEMORY)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run_dir = tmp_path / "run"
    for mode in ("write", "measure"):  # separate processes: the writer's freed memory must not hide the peak
        cmd = [sys.executable, str(script), mode, str(run_dir)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["weights"] >= 100e6
    extra = found["peak"] - found["before"]
    assert extra <= 2.0 * found["weights"], f"peak {extra / 2**20:.0f} MB over {found['weights'] / 2**20:.0f} MB"


def test_consolidate_publishes_every_file_durably(cfg: Config, run: RunDir, source: nn.Module) -> None:
    """Under strace: model.safetensors, model.json and manifest.json each reach their name only after an fsync of
    their data, so a power cut cannot leave a name pointing at data that never reached the disk."""
    log = run.path.parent / "strace.log"
    proc = strace([sys.executable, "-m", "pipeline", "consolidate", "--run-dir", str(run.path)], log, text=True)
    assert proc.returncode == 0
    assert publishes(log, run.path) >= 3  # the weights, model.json, the manifest: the trace saw them
    assert unsynced_publishes(log, run.path) == []


def test_a_killed_consolidates_temp_file_is_removed_by_the_next(cfg: Config, run: RunDir, source: nn.Module) -> None:
    leftover = run.path / "model" / ".model.safetensors.99999.tmp"  # what a SIGKILL mid-write leaves
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a file")
    consolidate.run(cfg, run, log=lambda _: None)
    assert not leftover.exists() and (run.path / "model" / "model.safetensors").is_file()
