"""Build the project's wheel from a snapshot of the working tree, as `pip install .` would, for packaging tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` with a throwaway identity; its stdout."""
    identity = ["-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    return subprocess.run(["git", "-C", str(repo), *identity, *args], check=True, capture_output=True, text=True).stdout


def snapshot(dest: Path) -> str:
    """Copy the working tree as it is (uncommitted changes included, ignored files left out) into a fresh git
    repository at `dest`; its commit."""
    files = git(REPO, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).symlink_to(src.readlink())
        elif src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    git(dest, "init", "-q")
    git(dest, "add", ".")
    git(dest, "commit", "-q", "-m", "snapshot")
    return git(dest, "rev-parse", "HEAD").strip()


def build_wheel(what: str, out: Path) -> Path:
    """`pip wheel` of a source directory or sdist, with this venv's setuptools; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), what]
    subprocess.run(cmd, check=True, capture_output=True, cwd=out.parent)
    (wheel,) = out.glob("*.whl")
    return wheel


def install_target(wheel: Path, site: Path) -> Path:
    """Install `wheel` alone into `site` (dependencies come from this venv, through PYTHONPATH=site)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)])
    return site
