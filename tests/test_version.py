"""Where `pipeline --version` gets the source revision: git in a checkout, the build's record in a wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from pipeline import __version__, version
from pipeline.version import git_revision
from tests.wheels import REPO, build_wheel, git, install_target, snapshot


def test_version_names_the_package_version_and_the_checkout_revision(tmp_path: Path):
    shown = subprocess.run(
        [sys.executable, "-m", "pipeline", "--version"], capture_output=True, text=True, cwd=tmp_path
    )
    assert shown.returncode == 0, shown.stderr
    described = subprocess.run(  # the full commit, `-dirty` with uncommitted changes; tags left out
        ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
        capture_output=True,
        text=True,
    )
    revision = described.stdout.strip() if described.returncode == 0 else "unknown"
    assert shown.stdout == f"edge-pipeline {__version__} (revision {revision})\n"


def test_git_revision_of_a_work_tree(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git(repo, "init", "-q")
    assert git_revision(repo) is None  # no commit yet
    (repo / "pkg/a.py").write_text("a = 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "HEAD").strip()
    assert git_revision(repo) == head
    (repo / "untracked.txt").write_text("build output\n")
    assert git_revision(repo) == head  # untracked files do not change what was built
    (repo / "pkg/a.py").write_text("a = 2\n")
    assert git_revision(repo) == f"{head}-dirty"
    # A directory inside the work tree (site-packages of a venv kept in a checkout) is not the checkout's code.
    assert git_revision(repo / "pkg") is None
    assert git_revision(tmp_path) is None


def test_the_build_record_comes_before_git(monkeypatch: pytest.MonkeyPatch):
    record = types.ModuleType("pipeline._revision")
    record.REVISION = "0123abcd"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pipeline._revision", record)
    assert version.revision() == "0123abcd"
    assert version.describe() == f"edge-pipeline {__version__} (revision 0123abcd)"


def test_wheels_record_the_revision_they_were_built_from(tmp_path: Path):
    """A wheel built from a checkout, and one built from an sdist (no .git there), both know the commit; the
    installed package reports it with no git repository around it."""
    pytest.importorskip("setuptools", reason="builds with this venv's setuptools (--no-build-isolation)")
    source = tmp_path / "src"
    head = snapshot(source)
    wheel = build_wheel(str(source), tmp_path / "from-checkout")
    build_sdist = "from setuptools import build_meta; print(build_meta.build_sdist('../sdist'))"
    sdist = subprocess.run([sys.executable, "-c", build_sdist], check=True, capture_output=True, text=True, cwd=source)
    from_sdist = build_wheel(str(tmp_path / "sdist" / sdist.stdout.split()[-1]), tmp_path / "from-sdist")
    for built in (wheel, from_sdist):
        with zipfile.ZipFile(built) as archive:
            assert archive.read("pipeline/_revision.py").decode().endswith(f"REVISION = {head!r}\n")

    site = install_target(wheel, tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the editable install; dependencies from this venv
    shown = subprocess.run(
        [sys.executable, "-m", "pipeline", "--version"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert shown.stdout == f"edge-pipeline {__version__} (revision {head})\n", shown.stderr
    assert not (source / "pipeline/_revision.py").exists()  # the record is written into builds, never the source
