"""The checkpoint directory's bookkeeping (ordering, the `latest` pointer, pruning) and saves on two real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import models
from pipeline import layout
from pipeline.config import Config, validate
from pipeline.errors import PipelineError
from pipeline.files import write_json
from pipeline.train.rank import checkpoint, runtime
from tests import durability
from tests.train.ranks import run_ranks


def _make(root: Path, *steps: int) -> None:
    for step in steps:
        write_json(root / f"step-{step}" / checkpoint.TRAINER_JSON, {"epoch": 0, "step": step})


def test_step_dirs_are_ordered_by_step_number_not_name(tmp_path: Path) -> None:
    _make(tmp_path, 9, 10, 100)
    (tmp_path / "step-x").mkdir()
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-100", "step-10", "step-9"]


def test_latest_is_none_without_a_pointer_and_follows_it_otherwise(tmp_path: Path) -> None:
    _make(tmp_path, 10, 20)
    assert checkpoint.latest(tmp_path) is None
    checkpoint.point_latest(tmp_path, "step-10")
    checkpoint.point_latest(tmp_path, "step-20")
    assert checkpoint.latest(tmp_path) == (tmp_path / "step-20").resolve()
    assert (tmp_path / "latest").readlink() == Path("step-20")  # relative: the run dir can move
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_latest_pointing_at_an_incomplete_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "step-5").mkdir()
    checkpoint.point_latest(tmp_path, "step-5")
    with pytest.raises(PipelineError, match=r"latest: points to step-5"):
        checkpoint.latest(tmp_path)


def test_prune_keeps_the_newest_and_never_the_one_latest_points_to(tmp_path: Path) -> None:
    _make(tmp_path, 10, 20, 30, 40)
    checkpoint.point_latest(tmp_path, "step-20")
    deleted = checkpoint.prune(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step-10", "step-30"]
    assert sorted(p.name for p in checkpoint.step_dirs(tmp_path)) == ["step-20", "step-40"]


def test_only_a_checkpoint_of_the_same_data_and_model_is_resumable(tmp_path: Path) -> None:
    ours, other = validate({}, "test"), validate({"data": {"image_size": 24}}, "test")
    assert checkpoint.resumable(tmp_path, ours) is None
    meta = {"epoch": 0, "step": 7, "resume_key": checkpoint.resume_key(ours)}
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path / "step-7", no_dist=True)
    write_json(tmp_path / "step-7" / checkpoint.TRAINER_JSON, meta)
    checkpoint.point_latest(tmp_path, "step-7")
    longer = validate({"train": {"epochs": 99}}, "test")  # train settings may change on resume
    assert checkpoint.resumable(tmp_path, longer) == (tmp_path / "step-7").resolve()
    with pytest.raises(PipelineError, match=r"step-7: written for a different data/model config"):
        checkpoint.resumable(tmp_path, other)


def test_saves_run_in_the_background_on_cuda_or_across_nodes_unless_the_config_says_otherwise() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [checkpoint.background(None, cpu, False), checkpoint.background(None, cuda, False)] == [False, True]
    assert checkpoint.background(None, cpu, across_nodes=True)
    assert [checkpoint.background(True, cpu, False), checkpoint.background(False, cuda, True)] == [True, False]


MODES = {"async": True, "sync": False}


def _save_then_keep_training(root: Path) -> None:
    """On each rank, per mode: checkpoint step 1 of a DDP model, change every weight at once, wait for the save."""
    rt = runtime.init(validate({}, "test").train)
    try:
        for mode, asynchronous in MODES.items():
            torch.manual_seed(0)
            model = DistributedDataParallel(models.build_model("small_cnn", 10, 1))
            optim = torch.optim.AdamW(model.parameters())
            F.cross_entropy(model(torch.randn(4, 1, 16, 16)), torch.tensor([0, 1, 2, 3])).backward()
            optim.step()
            ckpt = checkpoint.Checkpointer(root / mode, keep=2, asynchronous=asynchronous)
            if rt.is_main:
                torch.save(model.module.state_dict(), root / f"{mode}.pt")
            ckpt.save(model, optim, {"epoch": 0, "step": 1})
            if rt.is_main:
                (root / f"{mode}.latest-before-wait").write_text(str(checkpoint.latest(root / mode)))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # training goes on while the background write runs
            ckpt.wait()
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_holds_the_weights_of_its_step_and_latest_moves_once_it_is_written(tmp_path: Path) -> None:
    run_ranks(_save_then_keep_training, tmp_path)
    for mode, asynchronous in MODES.items():
        root = tmp_path / mode
        moved_early = (tmp_path / f"{mode}.latest-before-wait").read_text() != "None"
        assert moved_early == (not asynchronous)  # asynchronous: committed by wait(), not by save()
        assert checkpoint.latest(root) == (root / "step-1").resolve()
        model = models.build_model("small_cnn", 10, 1)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=root / "step-1", no_dist=True)
        expected = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        assert all(torch.equal(state["model"][k], expected[k]) for k in expected)
        assert sorted(p.name for p in (root / "step-1").glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]
        # Every replicated tensor is in rank 0's file: the checkpoint is whole without any other rank's files (a
        # cluster device that leaves after the save takes nothing the next round needs).
        storage = dcp.FileSystemReader(root / "step-1").read_metadata().storage_data
        assert {info.relative_path for info in storage.values()} == {"__0_0.distcp"}


def _save_on_own_node(root: Path) -> None:
    """Each rank a node of its own (`GROUP_RANK`) with its own disk (`root/node-<rank>`): rank 1 saves step 1 of a
    DDP model while rank 0 waits at a barrier it meets only after rank 1's save is committed; then rank 0 saves."""
    rt = runtime.init(validate({"train": {"pg_timeout_s": 60}}, "test").train)
    os.environ["GROUP_RANK"] = str(rt.rank)
    try:
        for mode, asynchronous in MODES.items():
            torch.manual_seed(0)
            model = DistributedDataParallel(models.build_model("small_cnn", 10, 1))
            optim = torch.optim.AdamW(model.parameters())
            ckpt = checkpoint.Checkpointer(root / mode / f"node-{rt.rank}", 2, asynchronous, per_node=True)
            if rt.is_main:
                torch.save(model.module.state_dict(), root / f"{mode}.pt")
                dist.barrier()  # a save that needed rank 0 would wait here for pg_timeout_s, and fail
            ckpt.save(model, optim, {"epoch": 0, "step": 1})
            ckpt.wait()
            if not rt.is_main:
                dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_per_node_each_node_commits_a_whole_checkpoint_of_its_own_without_the_others(tmp_path: Path) -> None:
    """Cluster training over SSH: a device lost after a save takes no other device's copy with it, whichever rank
    it ran, and a save costs no collective across the link."""
    run_ranks(_save_on_own_node, tmp_path)
    for mode in MODES:
        expected = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        for rank in (0, 1):
            root = tmp_path / mode / f"node-{rank}"
            assert checkpoint.latest(root) == (root / "step-1").resolve()
            state = {"model": models.build_model("small_cnn", 10, 1).state_dict()}
            dcp.load(state, checkpoint_id=root / "step-1", no_dist=True)
            assert all(torch.equal(state["model"][k], expected[k]) for k in expected)
            assert sorted(p.name for p in (root / "step-1").glob("rng-*.pt")) == [f"rng-{rank}.pt"]
            storage = dcp.FileSystemReader(root / "step-1").read_metadata().storage_data
            assert {info.relative_path for info in storage.values()} == {"__0_0.distcp"}


def _resumable_step(root: Path, cfg: Config) -> Path:
    """A complete checkpoint step-7 of `cfg` under `root`, `latest` on it, with rank 0's RNG state."""
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=root / "step-7", no_dist=True)
    write_json(
        root / "step-7" / checkpoint.TRAINER_JSON, {"epoch": 0, "step": 7, "resume_key": checkpoint.resume_key(cfg)}
    )
    torch.save(torch.get_rng_state(), root / "step-7" / "rng-0.pt")
    checkpoint.point_latest(root, "step-7")
    return root / "step-7"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", r"EOFError"),  # what a power cut leaves of a file written in place
        (b"garbage", r"UnpicklingError"),
        ("a dict", r"holds a dict, not an RNG state"),
    ],
)
def test_a_checkpoint_with_an_unreadable_rng_file_is_not_resumable(tmp_path: Path, content: bytes | str, why: str):
    cfg = validate({}, "test")
    step = _resumable_step(tmp_path, cfg)
    if isinstance(content, bytes):
        (step / "rng-1.pt").write_bytes(content)
    else:
        torch.save({"state": torch.zeros(3)}, step / "rng-1.pt")
    with pytest.raises(PipelineError, match=rf"step-7/rng-1\.pt: unreadable \({why}.*\); delete it to resume"):
        checkpoint.resumable(tmp_path, cfg)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("meta", [[1, 2], {"epoch": 0}, {"epoch": 0, "step": "7"}])
def test_a_trainer_json_without_integer_epoch_and_step_is_refused(tmp_path: Path, meta: object):
    cfg = validate({}, "test")
    step = _resumable_step(tmp_path, cfg)
    write_json(step / checkpoint.TRAINER_JSON, meta)
    with pytest.raises(PipelineError, match=r"step-7/trainer\.json: corrupt: needs an object with integer epoch"):
        checkpoint.resumable(tmp_path, cfg)


def test_a_checkpoint_and_its_rng_file_are_on_disk_before_latest_moves(tmp_path: Path) -> None:
    """Under strace, one rank (this process, a world of one): rng-0.pt reaches its name by a rename after an fsync,
    like every other file of the checkpoint, and the step directory is synced before `latest` switches."""
    root, log = tmp_path / "checkpoints", tmp_path / "save.strace"
    model = models.build_model("small_cnn", 10, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with durability.attached(os.getpid(), log):
            checkpoint.Checkpointer(root, keep=2, asynchronous=False).save(
                model, torch.optim.AdamW(model.parameters()), {"epoch": 0, "step": 1}
            )
    finally:
        dist.destroy_process_group()
    assert root / "step-1" / "rng-0.pt" in durability.published(log, root)
    assert durability.unsynced_publishes(log, root) == []


@pytest.mark.slow  # the quick suite keeps to 10 min; the unreadable-rng tests in this file cover the check itself
def test_resume_from_an_emptied_rng_file_is_one_line_through_the_cli(tmp_path: Path) -> None:
    """Train the quickstart for an epoch, empty rank 0's RNG file in the latest checkpoint (as a power cut leaves a
    file written in place), resume: exit 2, one line naming the file, no traceback, no rank started."""
    run = tmp_path / "run"
    train = [
        sys.executable,
        "-m",
        "pipeline",
        "train",
        "--run-dir",
        str(run),
        "--set",
        "train.nproc_per_node=1",
        "--set",
    ]
    first = subprocess.run([*train, "train.epochs=1"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    rng = run / layout.LATEST / "rng-0.pt"
    rng.write_bytes(b"")
    metrics = (run / layout.METRICS).read_text()
    again = subprocess.run([*train, "train.epochs=2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert again.returncode == 2, again.stderr
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "rng-0.pt: unreadable (EOFError" in lines[0], again.stderr
    assert (run / layout.METRICS).read_text() == metrics  # no rank started
