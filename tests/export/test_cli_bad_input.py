"""Bad input through the CLI (`python -m pipeline consolidate|export`): one line naming the file, exit 2, nothing
overwritten. Slow: each CLI process imports the whole pipeline (5-10 s, far more on a busy machine); the same errors
are checked in-process in test_export_stage.py, test_onnx_parity.py and test_consolidate.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.config import Config
from pipeline.manifest import RunDir


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert all(needle in lines[0] for needle in needles), lines[0]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_truncated_weights_stop_export_and_keep_the_earlier_files(
    make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    run = make_run(make_config(), with_onnx=True)
    weights = run.path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    before = _snapshot(run.path / "onnx")
    _one_line(_cli("export", "--run-dir", str(run.path)), f"{weights}: cannot read weights")
    assert _snapshot(run.path / "onnx") == before


@pytest.mark.slow
def test_checkpoint_of_another_architecture_stops_consolidate(
    consolidated: Path, make_config: Callable[..., Config], make_run: Callable[..., RunDir]
) -> None:
    run = make_run(make_config())
    shutil.copytree(consolidated / "train", run.path / "train", symlinks=True)
    before = _snapshot(run.path / "model")
    proc = _cli("consolidate", "--run-dir", str(run.path), "--set", 'model.name="mobilenet_v3_small"')
    _one_line(proc, "train/checkpoints/step-20", "does not fit model.name='mobilenet_v3_small'")
    assert _snapshot(run.path / "model") == before
