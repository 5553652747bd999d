"""Run a command in a session of its own, and stop it together with every process it started.

Signalling the process group is not enough for torchrun: it starts each rank in a session of its own, outside
its group. So every process started here carries a marker in its environment, which all its descendants
inherit whatever their session; stopping the job SIGTERMs the group (torchrun then stops its ranks in order),
and after a grace period SIGKILLs the group and every process that still carries the marker. On Linux the
kernel also SIGTERMs the command should the caller die without cleaning up (SIGKILL, a cancelled flow run).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MARKER = "PIPELINE_JOB"
"""Environment variable whose value identifies one job's processes."""
KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL."""
_PR_SET_PDEATHSIG = 1
# Resolved here, not in the forked child: between fork and exec the child may call it but not load libraries.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


@dataclass(frozen=True)
class Job:
    """A started command: its process (leader of a new session) and the marker its descendants carry."""

    proc: subprocess.Popen[bytes]
    token: str


def _terminate_with(parent: int) -> Callable[[], None] | None:
    """A pre-exec hook asking the kernel to SIGTERM the child when `parent` dies (Linux only, else None)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def start(cmd: list[str], env: dict[str, str]) -> Job:
    """Start `cmd` with `env` (plus the marker) as the leader of a new session; output is inherited."""
    token = secrets.token_hex(8)
    proc = subprocess.Popen(
        cmd, env={**env, MARKER: token}, start_new_session=True, preexec_fn=_terminate_with(os.getpid())
    )
    return Job(proc, token)


def members(token: str) -> list[int]:
    """Pids of running processes that carry the job's marker (read from /proc; empty where there is none)."""
    needle = f"{MARKER}={token}".encode()
    found = []
    proc_root = Path("/proc")
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for zombies: they no longer count
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    # The group id stays reserved while any member lives, so this never reaches an unrelated group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop(job: Job, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the job's group, wait up to `grace_s` for all its processes to end, SIGKILL the rest, reap.

    Cheap when the job has already finished: there is nothing to signal or wait for.
    """
    _signal_group(job.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (job.proc.poll() is None or members(job.token)):
        time.sleep(0.05)
    _signal_group(job.proc.pid, signal.SIGKILL)
    for pid in members(job.token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.proc.wait()
