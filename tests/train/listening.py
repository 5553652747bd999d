"""Which addresses a process tree listens on: `ss -ltnpH` rows of the processes in question."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def listeners(ss_output: str, pids: set[int] | None = None) -> list[tuple[str, int]]:
    """(local address, pid) of each listening TCP socket in `ss -ltnpH` output, of the processes `pids` (all: None)."""
    found = []
    for line in ss_output.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        for pid in map(int, re.findall(r"pid=(\d+)", fields[5])):
            if pids is None or pid in pids:
                found.append((fields[3], pid))
    return found


def tree_pids(root: int) -> set[int]:
    """`root` and every process it started, however deep (torchrun's ranks run in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def listening_here(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of each TCP socket that the processes `pids` of this host listen on."""
    return listeners(subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout, pids)
