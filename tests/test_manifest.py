"""The stage runner: lineage in the manifest, caching on content hashes, never on paths or timestamps."""

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Config, load_config
from pipeline.errors import PipelineError
from pipeline.manifest import RunDir, Stage, StageResult, create_run_dir, run_stage


def _copy_stage(run: RunDir, calls: list[str]):
    """A stage that copies in.txt to out.txt, counting its calls."""

    def body() -> StageResult:
        calls.append("ran")
        (run.path / "out.txt").write_text((run.path / "in.txt").read_text().upper())
        return StageResult("copy", "done", {"out": "out.txt"}, {"chars": 3})

    return body


def _run(run: RunDir, cfg: Config, calls: list[str]) -> StageResult:
    stage = Stage("copy", sections=("train",), inputs=("in.txt",), outputs={"out": "out.txt"}, run=_unused)
    return run_stage(run, cfg, stage, _copy_stage(run, calls), log=lambda _: None)


def _unused(*_args: object, **_kwargs: object) -> StageResult:
    raise AssertionError("the runner calls the body, not the stage's own entry point")


def test_unchanged_inputs_and_config_are_cached(tmp_path: Path):
    cfg = Config()
    run = create_run_dir(cfg, tmp_path / "run")
    (run.path / "in.txt").write_text("abc")
    calls: list[str] = []
    assert _run(run, cfg, calls).status == "done"
    second = _run(run, cfg, calls)
    assert second.status == "cached" and second.metrics == {"chars": 3}
    assert calls == ["ran"]
    entry = run.manifest()["stages"]["copy"]
    assert entry["inputs"] == {"in.txt": run.hashes(["in.txt"])["in.txt"]}
    assert entry["output_hashes"] == run.hashes(["out.txt"])


def test_changed_input_content_config_or_output_reruns(tmp_path: Path):
    cfg = Config()
    run = create_run_dir(cfg, tmp_path / "run")
    (run.path / "in.txt").write_text("abc")
    calls: list[str] = []
    _run(run, cfg, calls)
    (run.path / "in.txt").write_text("abd")  # same path, new content
    _run(run, cfg, calls)
    _run(run, load_config(None, ["train.epochs=2"]), calls)  # config the stage depends on
    (run.path / "out.txt").write_text("tampered")
    _run(run, load_config(None, ["train.epochs=2"]), calls)  # output changed behind our back
    assert len(calls) == 4
    _run(run, load_config(None, ["train.epochs=2", "deploy.keep_releases=9"]), calls)  # unrelated section
    assert len(calls) == 4


def test_config_snapshot_round_trips(tmp_path: Path):
    cfg = load_config(None, ["train.epochs=5"])
    run = create_run_dir(cfg, tmp_path / "run")
    assert run.load_config() == cfg
    assert run.manifest()["versions"]["torch"]


def _annotate_many(path: str, who: str, count: int) -> None:
    run = RunDir(Path(path))
    for i in range(count):
        run.annotate("keys", f"{who}-{i}", value=i)


def test_concurrent_manifest_updates_lose_nothing(tmp_path: Path):
    """Two processes annotating one run directory 200 times each: all 400 keys are kept (the reproduction kept
    212 without a lock)."""
    run = create_run_dir(Config(), tmp_path / "run")
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_annotate_many, args=(str(run.path), who, 200)) for who in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    assert len(run.manifest()["keys"]) == 400


def test_a_second_writer_of_the_same_stage_is_refused_naming_the_holder(tmp_path: Path):
    cfg = Config()
    run = create_run_dir(cfg, tmp_path / "run")
    (run.path / "in.txt").write_text("abc")
    holder = subprocess.Popen(  # holds the copy stage's lock, as a running `pipeline <stage>` would
        [sys.executable, "-c", HOLD_STAGE_LOCK, str(run.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(PipelineError, match=rf"stage copy is being run by pid {holder.pid} "):
            _run(run, cfg, [])
    finally:
        holder.kill()
        holder.wait()
    assert _run(run, cfg, []).status == "done"  # a dead holder's lock is gone with it


HOLD_STAGE_LOCK = """
import sys, time
from pathlib import Path
from pipeline.manifest import RunDir, stage_lock
with stage_lock(RunDir(Path(sys.argv[1])), "copy"):
    print("holding", flush=True)
    time.sleep(60)
"""
