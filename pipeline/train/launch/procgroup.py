"""Run a command in a session of its own, and stop it together with every process it started.

Signalling the process group is not enough for torchrun: it starts each rank in a session of its own, outside
its group (docs/torch-distributed.md#workers-outlive-their-agent). So every process started here carries a marker
in its environment, which all its descendants inherit whatever their session; stopping the job SIGTERMs the group
(torchrun then stops its ranks in order), and after a grace period SIGKILLs the group and every process that still
carries the marker. On Linux the kernel also SIGTERMs the command should the caller die without cleaning up
(SIGKILL, a cancelled flow run).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
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

    proc: subprocess.Popen[str]
    token: str
    pump: threading.Thread | None = None
    """Thread forwarding the job's output lines, when an output callback was given."""


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


def start(cmd: list[str], env: dict[str, str], output: Callable[[str], None] | None = None) -> Job:
    """Start `cmd` with `env` (plus the marker) as the leader of a new session.

    Output is inherited (a terminal sees progress bars live), or, with `output`, sent to it line by line: how a
    Prefect task gets torchrun's output into the run's logs.
    """
    token = secrets.token_hex(8)
    pipe = subprocess.PIPE if output else None
    proc = subprocess.Popen(
        cmd,
        env={**env, MARKER: token},
        start_new_session=True,
        preexec_fn=_terminate_with(os.getpid()),
        stdout=pipe,
        stderr=subprocess.STDOUT if output else None,
        text=True,
        errors="replace",
    )
    if output is None:
        return Job(proc, token)
    pump = threading.Thread(target=_forward, args=(proc, output), name="job-output", daemon=True)
    pump.start()
    return Job(proc, token, pump)


def _forward(proc: subprocess.Popen[str], output: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:  # text mode turns a progress bar's \r redraws into lines too
        if line.strip():
            output(line.rstrip())


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
    if job.pump is not None:
        job.pump.join(timeout=grace_s)
