"""The package stands alone: installed from its wheel, `pipeline run` works in an empty directory, outside the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.wheels import build_wheel, install_target, snapshot


@pytest.mark.slow
def test_the_installed_wheel_runs_the_quickstart_from_an_empty_directory(tmp_path: Path):
    """The default config ships inside the wheel and is found without `--config`; the package is imported from
    the install (PYTHONPATH names only it, ahead of this venv's editable install; the run's cwd is empty).
    A fresh virtualenv with no editable install at all is checked by hand (docs/how-to/install-on-device.md, "The
    controller")."""
    pytest.importorskip("setuptools", reason="builds with this venv's setuptools (--no-build-isolation)")
    snapshot(tmp_path / "src")
    site = install_target(build_wheel(str(tmp_path / "src"), tmp_path / "wheel"), tmp_path / "site")
    assert (site / "pipeline/defaults/quickstart.toml").is_file() and not (site / "configs").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "--run-dir", "run", "--set", "train.epochs=2"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((empty / "run/manifest.json").read_text())
    assert manifest["config"]["run"]["name"] == "quickstart"  # the embedded default, found without a --config
    assert manifest["stages"]["deploy"]["status"] == "done"
    loaded = subprocess.run(  # the code that ran came from the install, not from the checkout
        [sys.executable, "-c", "import pipeline, models; print(pipeline.__file__, models.__file__)"],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
    )
    assert loaded.stdout.split() == [str(site / "pipeline/__init__.py"), str(site / "models/__init__.py")]
