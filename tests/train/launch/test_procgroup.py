"""Stopping a job with everything it started, including processes in sessions of their own (as torchrun's ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeline.train.launch import procgroup


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...]; [] once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return []


def _running(pid: int) -> bool:
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def test_stop_kills_descendants_in_other_sessions_that_ignore_sigterm(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    # Like a torchrun rank: its own session (out of reach of killpg) and, like a hung rank, deaf to SIGTERM.
    script = f"setsid sh -c 'trap \"\" TERM; echo $$ > {pidfile}; exec sleep 60' & sleep 60"
    job = procgroup.start(["sh", "-c", script], dict(os.environ))
    try:
        while not pidfile.exists() or not pidfile.read_text().strip():
            time.sleep(0.02)
        child = int(pidfile.read_text())
        assert _stat(child)[3] != _stat(job.proc.pid)[3]  # a different session
        assert {job.proc.pid, child} <= set(procgroup.members(job.token))
    finally:
        started = time.monotonic()
        procgroup.stop(job, grace_s=0.5)
    assert job.proc.returncode is not None
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _running(child)
    assert procgroup.members(job.token) == []
    assert time.monotonic() - started < 5


def test_stop_after_a_clean_exit_returns_at_once() -> None:
    job = procgroup.start(["true"], dict(os.environ))
    job.proc.wait()
    started = time.monotonic()
    procgroup.stop(job, grace_s=5)
    assert job.proc.returncode == 0
    assert time.monotonic() - started < 1


def test_output_callback_receives_every_line_including_stderr() -> None:
    lines: list[str] = []
    job = procgroup.start(
        ["sh", "-c", "echo one; echo two >&2; printf 'bar 1\\rbar 2\\n'"], dict(os.environ), lines.append
    )
    assert job.proc.wait(timeout=10) == 0
    procgroup.stop(job)
    assert lines == ["one", "two", "bar 1", "bar 2"]
