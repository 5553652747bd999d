"""The package version and the source revision it was built from: what `pipeline --version` prints.

An installed wheel has no .git: its build wrote the revision into `pipeline/_revision.py` (setup.py does that, for
sdists too). Without that file the code runs from a git checkout (an editable install, or the source tree itself),
and git is asked at run time, so the answer follows new commits. Neither: `unknown`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

UNKNOWN = "unknown"
SOURCE_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package is in, when it runs from one (else: site-packages)."""


def git_revision(root: Path) -> str | None:
    """HEAD of the git work tree whose top directory is `root`, with `-dirty` appended when tracked files have
    uncommitted changes; None when `root` is not the top of a work tree or git is not installed."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    # A wheel installed into a venv inside some other checkout is in that work tree too: only its top counts.
    if top is None or Path(top).resolve() != root.resolve():
        return None
    head = git("rev-parse", "HEAD")
    if head is None:  # a repository without commits
        return None
    return f"{head}-dirty" if git("status", "--porcelain", "--untracked-files=no") else head


def revision() -> str:
    """The source revision this code was built from: a commit hash (`-dirty` when built from a modified tree),
    or `unknown`."""
    try:
        from pipeline._revision import REVISION  # written by the build; a checkout has none
    except ImportError:
        return git_revision(SOURCE_ROOT) or UNKNOWN
    return REVISION


def describe() -> str:
    """One line: `edge-pipeline <version> (revision <commit>)`."""
    from pipeline import __version__  # here, not above: setup.py loads this file without the package importable

    return f"edge-pipeline {__version__} (revision {revision()})"
