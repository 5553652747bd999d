"""The train stage end to end: real torchrun, two gloo ranks, the built-in digits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import models
from pipeline import data, layout, train
from pipeline.config import Config, validate
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.manifest import RunDir, create_run_dir
from pipeline.train.launch.procgroup import KILL_GRACE_S
from tests.train.listening import listening_here, tree_pids

STEPS_PER_EPOCH = 23  # ceil(1437 training digits / 2 ranks / 32 per rank)


def small_config(**train: Any) -> Config:
    """The default digits/small_cnn config with 2 CPU ranks and the given `train.*` overrides."""
    return validate({"train": {"nproc_per_node": 2, **train}}, "test")


def rank_processes(run_dir: Path) -> set[int]:
    """Pids of live torchrun/worker processes started for `run_dir` (zombies have no cmdline and don't count)."""
    needle = str(run_dir.resolve()).encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        if b"pipeline.train.rank.worker" in argv and needle in argv:
            found.add(int(entry.name))
    return found


def _lines(run: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run.path / layout.METRICS).read_text().splitlines()]


def _gradient_bytes(itemsize: int) -> int:
    params = sum(p.numel() for p in models.build_model("small_cnn", 10, 1).parameters())
    return params * itemsize


FIRST, TOTAL = 2, 6  # epochs of the first invocation, then of the resumed one


def final_config() -> Config:
    return small_config(epochs=TOTAL, compression="fp16", keep_checkpoints=2)


@pytest.fixture(scope="module")
def listening() -> Iterator[set[str]]:
    """Every address that this process or one it started listens on, while the module's tests run."""
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            seen.update(addr for addr, _ in listening_here(tree_pids(os.getpid())))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield seen
    done.set()
    watcher.join()


@pytest.fixture(scope="module")
def trained(
    tmp_path_factory: pytest.TempPathFactory, listening: set[str]
) -> tuple[RunDir, train.StageResult, list[dict[str, Any]]]:
    """One run dir trained twice: FIRST epochs uncompressed, then resumed to TOTAL epochs with fp16 compression.

    Returns the run, the second result and the metrics lines after the first invocation. (One fixture for all
    of this keeps the launches, ~10 s of start-up each on 2 cores, within the test budget.)
    """
    first_cfg = small_config(epochs=FIRST, compression="none", keep_checkpoints=2)
    run = create_run_dir(first_cfg, tmp_path_factory.mktemp("trained") / "run")
    train.run(first_cfg, run, log=lambda _: None)
    first = _lines(run)
    return run, train.run(final_config(), run, log=lambda _: None), first


Trained = tuple[RunDir, train.StageResult, list[dict[str, Any]]]


def test_reaches_accuracy_and_reports_it(trained: Trained) -> None:
    run, result, _ = trained
    summary = read_json(run.path / layout.SUMMARY)
    assert result.status == "done"
    assert result.outputs == train.STAGE.outputs
    assert summary["val_accuracy"] >= 0.9
    assert result.metrics == {k: summary[k] for k in train.SUMMARY_METRICS}
    assert summary["steps"] == TOTAL * STEPS_PER_EPOCH
    assert (summary["world_size"], summary["backend"], summary["precision"]) == (2, "gloo", "fp32")
    assert summary["compression"] == "fp16"
    assert summary["samples_per_s"] > 0 and summary["seconds"] > 0
    assert read_json(run.path / layout.DATASET)["classes"] == [str(i) for i in range(10)]
    assert run.manifest()["stages"]["train"]["inputs"] == {"data": data.fingerprint(small_config().data)}


def test_a_run_on_one_host_listens_on_loopback_only(trained: Trained, listening: set[str]) -> None:
    """The rendezvous store, the ranks' store and gloo, seen while `trained` ran: on 127.0.0.1, not on every interface
    as torch's own would be (docs/security.md#the-rendezvous-store)."""
    assert len({addr.rsplit(":", 1)[1] for addr in listening}) >= 3, listening  # the two stores and gloo, at least
    assert all(addr.startswith("127.0.0.1:") for addr in listening), listening


def test_metrics_lines_have_the_documented_fields(trained: Trained) -> None:
    run, _, _ = trained
    lines = _lines(run)
    steps = [r for r in lines if "step" in r]
    epochs = [r for r in lines if "val_accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, TOTAL * STEPS_PER_EPOCH + 1))
    assert all({"step", "epoch", "loss", "lr", "comm_bytes", "samples_per_s"} <= r.keys() for r in steps)
    assert [r["epoch"] for r in epochs] == list(range(TOTAL))
    assert all(0.0 <= r["val_accuracy"] <= 1.0 and r["val_loss"] > 0 for r in epochs)
    assert steps[0]["lr"] > steps[-1]["lr"]  # cosine decay
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_resume_continues_from_the_checkpoint(trained: Trained) -> None:
    run, _, first = trained
    assert {r["epoch"] for r in first} == set(range(FIRST))
    second = _lines(run)
    assert second[: len(first)] == first
    added = second[len(first) :]
    assert {r["epoch"] for r in added} == set(range(FIRST, TOTAL))
    assert added[0]["step"] == FIRST * STEPS_PER_EPOCH + 1


def test_comm_bytes_are_the_gradient_size_and_fp16_halves_them(trained: Trained) -> None:
    run, _, first = trained
    uncompressed = {r["comm_bytes"] for r in first if "step" in r}
    fp16 = {r["comm_bytes"] for r in _lines(run)[len(first) :] if "step" in r}
    assert uncompressed == {_gradient_bytes(4)}
    assert fp16 == {_gradient_bytes(2)}


def test_rerun_with_unchanged_inputs_is_cached(trained: Trained) -> None:
    run, result, _ = trained
    again = train.run(final_config(), run, log=lambda _: None)
    assert again.status == "cached" and again.metrics == result.metrics


def test_checkpoints_are_pruned_and_latest_is_newest(trained: Trained) -> None:
    run, _, _ = trained
    root = run.path / layout.CHECKPOINTS
    newest, previous = f"step-{TOTAL * STEPS_PER_EPOCH}", f"step-{(TOTAL - 1) * STEPS_PER_EPOCH}"
    assert sorted(p.name for p in root.glob("step-*")) == sorted([previous, newest])
    assert (root / "latest").readlink() == Path(newest)
    assert read_json(root / "latest" / "trainer.json")["epoch"] == TOTAL - 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_latest_checkpoint_loads_in_one_process_into_a_fresh_model(trained: Trained) -> None:
    run, _, _ = trained
    latest = run.path / layout.LATEST
    keys = FileSystemReader(latest).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in keys} == {"model", "optim"}
    assert not any(k.startswith("model.module.") for k in keys)
    model = models.build_model("small_cnn", 10, 1)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=latest, no_dist=True)
    model.load_state_dict(state["model"])
    x, y = data.val_batch(data.load(small_config().data, 0, channels=1), 10_000)
    with torch.no_grad():
        accuracy = (model.eval()(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy == pytest.approx(read_json(run.path / layout.SUMMARY)["val_accuracy"], abs=1e-6)


def test_timeout_stops_every_rank_process(tmp_path: Path) -> None:
    cfg = small_config(epochs=100_000, timeout_s=10)
    run = create_run_dir(cfg, tmp_path / "run")
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(rank_processes(run.path))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=r"train\.timeout_s"):
            train.run(cfg, run, log=lambda _: None)
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - started < 10 + KILL_GRACE_S + 5
    assert len(seen) >= 3  # torchrun and both ranks were running
    assert rank_processes(run.path) == set()
    assert "train" not in run.manifest()["stages"]


def test_killing_the_caller_stops_every_rank_process(tmp_path: Path) -> None:
    run = create_run_dir(small_config(epochs=100_000), tmp_path / "run")
    code = f"from pipeline import train, manifest as m; r = m.RunDir({str(run.path)!r}); train.run(r.load_config(), r)"
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(rank_processes(run.path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(rank_processes(run.path)) >= 3  # torchrun and both ranks
    finally:
        caller.kill()  # no cleanup code of the caller runs
        caller.wait()
    deadline = time.monotonic() + 20
    while rank_processes(run.path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes(run.path) == set()
