"""A CPU quota for a process: a cgroup of its own, the stand-in for a slow or throttled board (issue #31's half-speed
device). cgroup v2's `cpu.max` where the machine has it, else v1's `cpu.cfs_quota_us` (this machine: v1)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
"""The quota's period: 10 ms, a tenth of the kernel's default, so that a held process is slowed evenly through a
training step of a few tens of milliseconds rather than stopped for 50 ms out of every 100."""


def _root() -> Path:
    return V2 if (V2 / "cgroup.controllers").exists() else V1_CPU


def unavailable() -> str | None:
    """Why no CPU quota can be set here, or None."""
    if os.geteuid() != 0:
        return "needs root (a cgroup of its own)"
    if not os.access(_root(), os.W_OK):
        return f"{_root()} is not writable"
    return None


@contextlib.contextmanager
def cpu_quota(cores: float, name: str = "held") -> Iterator[Path]:
    """A fresh cgroup limited to `cores` CPUs; yields its `cgroup.procs` (write a pid there to move that process
    in). Removed on exit, its processes moved back to the root group."""
    group = _root() / f"pipeline-{name}-{os.getpid()}"
    group.mkdir()
    quota = int(cores * PERIOD_US)
    if _root() == V2:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    try:
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()
