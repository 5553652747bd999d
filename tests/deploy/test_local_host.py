"""LocalHost, the transport of local targets: commands end at their timeout, and nothing they start outlives them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pipeline.deploy.hosts import LocalHost, LocalSpot


def host(tmp_path: Path) -> LocalHost:
    return LocalHost(LocalSpot(name="here", root=str(tmp_path), health_command=""))


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_commands_end_at_their_timeout_with_their_children(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    started = time.perf_counter()
    out = asyncio.run(host(tmp_path).run(f"echo started; sleep 30 & echo $! > {pid_file}; wait", timeout_s=1))
    assert (out.exit_status, out.stdout) == (124, "started\n") and time.perf_counter() - started < 5
    assert not running(int(pid_file.read_text()))


def test_a_command_given_up_on_is_killed_with_its_process_group(tmp_path: Path):
    pid_file = tmp_path / "child.pid"

    async def give_up() -> None:
        await asyncio.wait_for(host(tmp_path).run(f"sleep 30 & echo $! > {pid_file}; wait", timeout_s=60), 1)

    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        asyncio.run(give_up())
    assert time.perf_counter() - started < 5  # not waiting for the command to finish on its own
    deadline = time.monotonic() + 5
    while running(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(int(pid_file.read_text()))


def test_put_copies_whole_files_only(tmp_path: Path):
    source = tmp_path / "model.onnx"
    source.write_bytes(b"x" * 1000)
    (tmp_path / "releases").mkdir()
    sent = asyncio.run(host(tmp_path).put(source, str(tmp_path / "releases/model.onnx")))
    assert sent == 1000 and (tmp_path / "releases/model.onnx").read_bytes() == b"x" * 1000
    assert sorted(p.name for p in (tmp_path / "releases").iterdir()) == ["model.onnx"]  # the .tmp was renamed
