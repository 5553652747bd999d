"""Where trtexec runs: here (`Local`) or on a device over SSH (`Remote`), behind one small async interface.

A runner owns a work directory the tool sees; `put` makes a file available to the tool under a name (uploaded to a
device; read where it is here), `get` copies one back, `tool` runs trtexec with arguments that name files by their
`path`. The build and verification steps are written once against it.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
from pathlib import Path
from typing import Protocol

import asyncssh

from pipeline.errors import PipelineError
from pipeline.files import sha256_file
from pipeline.fleet.ssh import FAILURES, Device
from pipeline.trt.trtexec import run_logged

TIMEOUT_STATUS = 124
"""Exit status of `timeout` (coreutils) when it stopped the command."""


class Runner(Protocol):
    """A place where trtexec runs, with a work directory."""

    where: str
    """Shown in messages: "this host" or "device <name>"."""
    exe: str
    """trtexec as the runner calls it (recorded in build.json's `command`)."""

    def path(self, name: str) -> str:
        """How the tool names file `name` (one given to `put`, or one it writes in the work directory)."""
        ...

    async def put(self, local: Path, name: str) -> None:
        """Make `local` available to the tool as `name`."""
        ...

    async def get(self, name: str, local: Path) -> bool:
        """Copy `name` from the work directory to `local`; False when it does not exist."""
        ...

    async def sha256(self, name: str) -> str | None:
        """sha256 of `name` as the runner's side computes it; None when it does not exist."""
        ...

    async def tool(self, args: list[str], log: Path, timeout_s: int) -> tuple[int, str]:
        """Run trtexec with `args`; output (stdout and stderr) also goes to `log`. Returns (status, output)."""
        ...


class Local:
    """trtexec on this host; the work directory is a local staging directory."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.exe = exe
        self.workdir = workdir
        self.where = "this host"
        self._placed: dict[str, Path] = {}

    def path(self, name: str) -> str:
        """Absolute path of `name`: the file given to `put`, else the work directory's."""
        return str(self._placed.get(name, self.workdir / name))

    async def put(self, local: Path, name: str) -> None:
        """Let the tool read `local` where it is: no copy of a large ONNX file, whose external-data files (if any)
        stay beside it, and build.json's command names the run's own file."""
        self._placed[name] = local

    async def get(self, name: str, local: Path) -> bool:
        """Copy `name` out (nothing to do when it is already there)."""
        src = Path(self.path(name))
        if not src.is_file():
            return False
        if src.resolve() != local.resolve():
            shutil.copyfile(src, local)
        return True

    async def sha256(self, name: str) -> str | None:
        """sha256 of the local file."""
        path = Path(self.path(name))
        return sha256_file(path) if path.is_file() else None

    async def tool(self, args: list[str], log: Path, timeout_s: int) -> tuple[int, str]:
        """Run trtexec in its own process group under `timeout_s` (run_logged kills the group on timeout)."""
        return run_logged([self.exe, *args], log, timeout_s)


class Remote:
    """trtexec on a device over SSH (pipeline.fleet.ssh.Device); the work directory is a private temp directory
    there (`mktemp -d`: a name nobody can guess or hold beforehand), made by `open` and removed by `close`."""

    def __init__(self, device: Device, exe: str) -> None:
        self.device = device
        self.exe = exe
        self.workdir = ""
        self.where = f"device {device.target.name}"
        self._sftp: asyncssh.SFTPClient | None = None

    def path(self, name: str) -> str:
        """Path of `name` on the device."""
        if not self.workdir:
            raise RuntimeError(f"{self.where}: the work directory is not open")
        return f"{self.workdir}/{name}"

    async def _client(self) -> asyncssh.SFTPClient:
        if self._sftp is None:
            self._sftp = await self.device.conn.start_sftp_client()
        return self._sftp

    async def put(self, local: Path, name: str) -> None:
        """Upload (to a temp name, then renamed)."""
        await self.device.put(local, self.path(name))

    async def get(self, name: str, local: Path) -> bool:
        """Download over SFTP."""
        sftp = await self._client()
        if not await sftp.exists(self.path(name)):
            return False
        await sftp.get(self.path(name), str(local))
        return True

    async def sha256(self, name: str) -> str | None:
        """`sha256sum` on the device."""
        out = await self.device.run(f"sha256sum {shlex.quote(self.path(name))}", timeout_s=120)
        return out.stdout.split()[0] if out.ok and out.stdout.split() else None

    async def tool(self, args: list[str], log: Path, timeout_s: int) -> tuple[int, str]:
        """Run trtexec under the device's own `timeout -k 5 N` (Device.run), stderr merged into stdout."""
        out = await self.device.run(shlex.join([self.exe, *args]) + " 2>&1", timeout_s=timeout_s)
        log.write_text(out.stdout + out.stderr)
        if out.exit_status == TIMEOUT_STATUS:
            raise PipelineError(f"build.timeout_s: trtexec on {self.where} did not finish within {timeout_s}s (killed)")
        return out.exit_status, out.stdout + out.stderr

    async def open(self) -> None:
        """Create the work directory (mode 700) in the device's temp directory."""
        out = await self.device.run('mktemp -d "${TMPDIR:-/tmp}/edge-build.XXXXXXXX"', timeout_s=30)
        if not out.ok or not out.stdout.strip():
            raise PipelineError(f"{self.where}: cannot create a temp directory: {out.tail()}")
        self.workdir = out.stdout.strip()

    async def close(self) -> None:
        """Remove the work directory (best effort: the device may be gone)."""
        if self.workdir:
            with contextlib.suppress(*FAILURES):
                await self.device.run(f"rm -rf {shlex.quote(self.workdir)}", timeout_s=60)
