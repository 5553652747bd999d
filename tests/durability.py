"""Syscall traces that show whether a command publishes data durably: every rename that puts a file in place must
come after an fsync of that file's data (strace -f -y prints the path behind each descriptor)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

TRACED = "fsync,fdatasync,rename,renameat,renameat2"
_FSYNC = re.compile(r"^\d+ +f(?:data)?sync\(\d+<(?P<path>[^>]*)>\) = 0")
_RENAME = re.compile(r'^\d+ +rename(?:at2?)?\((?:[^,]*, )?"(?P<src>[^"]*)", (?:[^,]*, )?"(?P<dst>[^"]*)"')


def strace(cmd: Sequence[str], log: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `cmd` under strace, following children, with the renames and fsyncs in `log`; skips without strace."""
    exe = shutil.which("strace")
    if exe is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace; `make test` installs it as root)")
    return subprocess.run([exe, "-f", "-qq", "-y", "-e", f"trace={TRACED}", "-o", str(log), *cmd], **kwargs)  # type: ignore[call-overload]


def unsynced_publishes(log: Path, root: Path) -> list[str]:
    """Renames into `root` of regular files (still there afterwards, not symlinks) whose data was not fsynced
    before the rename; each as `src -> dst`. An empty list means every publish was durable."""
    synced: set[str] = set()
    bad: list[str] = []
    for line in log.read_text().splitlines():
        if match := _FSYNC.match(line):
            synced.add(match["path"])
        elif match := _RENAME.match(line):
            src, dst = match["src"], Path(match["dst"])
            inside = dst.is_absolute() and dst.is_relative_to(root)
            if inside and dst.is_file() and not dst.is_symlink() and src not in synced:
                bad.append(f"{src} -> {dst}")
    return bad


def publishes(log: Path, root: Path) -> int:
    """How many renames into `root` the trace holds (so a test can tell that it saw the writes at all)."""
    return sum(1 for line in log.read_text().splitlines() if (m := _RENAME.match(line)) and root.as_posix() in m["dst"])
