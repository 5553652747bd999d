"""Process plumbing shared by the harness: finding tools, starting processes that die with the test, reaping them."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


class HarnessError(RuntimeError):
    """A stand-in device failed to start or a harness operation failed; the message says which and why."""


def which(tool: str) -> str | None:
    """Path of `tool`, also looking in /usr/sbin and /sbin (sshd, ip), which a venv's or user's PATH may lack."""
    return shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def tool(name: str) -> str:
    """Path of `name`, or HarnessError."""
    path = which(name)
    if path is None:
        raise HarnessError(f"{name} not found (see tests.harness.harness_unavailable)")
    return path


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test process dies without cleaning up (os._exit, SIGKILL),
    # the kernel kills the harness process too instead of leaving sshd servers and namespaces behind.
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(argv: list[str], *, env: Mapping[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a harness process in its own session (a Ctrl-C of pytest must not reach it: close() stops it).

    Its stderr goes to `log` (appended). The parent-death signal fires when the *thread* that forked exits, so it
    is only set from the main thread.
    """
    preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
    with open(log or os.devnull, "ab") as err:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=preexec,
        )


def wait_gone(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Reap `proc`, SIGKILLing it if it has not exited within `timeout` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_exec(proc: subprocess.Popen[bytes], comm: str, deadline: float, log: Path) -> None:
    """Wait until `proc` runs `comm`: unshare execs its command only once the new namespace exists, and work meant
    for the namespace done before that would hit the host's."""
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != comm:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise HarnessError(f"namespace holder did not start: {log.read_text().strip() if log.exists() else ''}")
        time.sleep(0.002)


def run(argv: list[str], *, input: str | None = None, what: str = "") -> str:
    """Run a short harness command; its stdout, or HarnessError with its stderr."""
    result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise HarnessError(f"{what or argv[0]}: `{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


def in_own_namespace(pid: int, kind: str) -> bool:
    """True when process `pid` is in a different `kind` namespace (net, mnt, ...) than this process."""
    return os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}")
