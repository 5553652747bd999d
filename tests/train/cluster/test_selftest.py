"""`pipeline cluster check --deep` against a stand-in device (tests/harness: a real sshd with a private disk, this
venv's Python): the backend with a peer on the device, a training step, the installed release's inference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from pipeline import layout
from tests.harness import JetsonTarget, TargetSpec
from tests.train.cluster.test_cluster import PYTHON_PREFIX, REPO, inventory, jetson_fleet, run_cli

__all__ = ["jetson_fleet"]  # a fixture, used by name


def install_release(device: JetsonTarget, model: Path, wrong_answer: bool = False) -> None:
    """A release as deploy leaves one: `<root>/releases/<id>/` (model, sample with its expected logits, labels) and
    `<root>/current` pointing at it."""
    release = device.disk / layout.RELEASES / "r1"
    release.mkdir(parents=True)
    shutil.copyfile(model, release / layout.ONNX_NAME)
    x = np.random.default_rng(3).standard_normal((1, 1, 16, 16)).astype(np.float32)
    logits = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["logits"], {"input": x})[0]
    if wrong_answer:
        logits[0, logits.argmax()] = logits.min() - 1.0
    np.savez(release / layout.SAMPLE_NAME, input=x, label=np.int64(0), logits=logits)
    (release / layout.LABELS).write_text("".join(f"{i}\n" for i in range(10)))
    (device.disk / layout.CURRENT).symlink_to(f"{layout.RELEASES}/r1")


@pytest.mark.slow  # about a minute: two device sessions, torch imported three times on the device
def test_the_deep_check_times_each_part_on_the_device_and_names_a_release_that_fails(
    jetson_fleet, small_onnx: Path, tmp_path: Path
) -> None:
    fleet = jetson_fleet([TargetSpec("node-1", disk_size="256m", host_dirs=(PYTHON_PREFIX, str(REPO)))])
    inv = inventory(fleet)
    check = ("cluster", "check", "--deep", "--inventory", str(inv), "--set", "model.name=small_cnn", "--json")
    out = run_cli(*check, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    [row] = json.loads(out.stdout)
    assert row["selftest"] == "passed" and row["backend"] == "gloo" and "gloo" in row["backends"]
    assert row["all_reduce_ms"] > 0 and row["train_step_ms"] > 0 and row["device"] == "cpu"
    assert row["inference"] == "no release"  # nothing deployed yet: said, not a failure

    install_release(fleet["node-1"], small_onnx)
    [row] = json.loads(run_cli(*check, cwd=tmp_path).stdout)
    assert row["selftest"] == "passed" and row["inference"] == "onnxruntime" and row["inference_ms"] > 0

    shutil.rmtree(fleet["node-1"].disk / layout.RELEASES)
    (fleet["node-1"].disk / layout.CURRENT).unlink()
    install_release(fleet["node-1"], small_onnx, wrong_answer=True)
    failed = run_cli(*check[:-1], cwd=tmp_path)  # the table, not --json: what a user sees
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines()[-1].startswith("error: node-1: self-test failed: release: ")
