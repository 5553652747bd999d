"""Where a deploy's target-side steps run: an SSH `Device`, or `LocalHost` for a local target.

Both run a command as `timeout -k 5 N sh -c COMMAND` and put a file as `<name>.tmp` renamed when whole, so the steps
in `remote` and `activate.sh` are one implementation: a local target is a device reached without SSH.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.config import DeployConfig, LocalTarget
from pipeline.fleet.ssh import Completed

HEALTH_SCRIPT = Path(__file__).with_name("health.py")


class Spot(Protocol):
    """What the steps need of a target (an inventory's `SshTarget`, or `LocalSpot`)."""

    @property
    def name(self) -> str: ...

    @property
    def root(self) -> str: ...

    @property
    def service(self) -> str: ...

    @property
    def health_command(self) -> str: ...


class Host(Protocol):
    """A target to run commands on and put files to, entered with `async with` (which connects, for SSH)."""

    @property
    def target(self) -> Spot: ...

    async def __aenter__(self) -> Host: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def run(self, command: str, timeout_s: int | None = None) -> Completed: ...

    async def put(self, local: Path, remote: str) -> int: ...


@dataclass(frozen=True)
class LocalSpot:
    """A local target as the steps see it: no service to restart, and this controller's health check."""

    name: str
    root: str
    health_command: str
    service: str = ""


def local_spot(target: LocalTarget, cfg: DeployConfig) -> LocalSpot:
    """The local target with its root made absolute (relative roots are relative to the working directory)."""
    return LocalSpot(target.name, str(target.root.absolute()), health_command(cfg.health_atol, cfg.health_atol_fp16))


def health_command(atol: float, atol_fp16: float) -> str:
    """activate.sh's HEALTH_COMMAND for local targets: `health.py` on `$RELEASE_DIR`, run by this interpreter.

    PYTHONPATH names this checkout, so the check is the controller's own code even where another copy is installed;
    the file runs as a script (`-P`: its directory stays off sys.path) because `-m` would first import the whole
    deploy package (asyncssh, pydantic: about a second), twice per activation.
    """
    code = shlex.quote(str(HEALTH_SCRIPT.parents[2]))
    args = f"--atol {atol!r} --atol-fp16 {atol_fp16!r}"
    return (
        f"PYTHONPATH={code}${{PYTHONPATH:+:$PYTHONPATH}} {shlex.quote(sys.executable)} -P "
        f'{shlex.quote(str(HEALTH_SCRIPT))} {args} "$RELEASE_DIR"'
    )


class LocalHost:
    """A local target's host: commands run here in their own process group, files are copied."""

    def __init__(self, target: LocalSpot, command_timeout_s: int = 300) -> None:
        self.target = target
        self.command_timeout_s = command_timeout_s

    async def __aenter__(self) -> LocalHost:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def run(self, command: str, timeout_s: int | None = None) -> Completed:
        """Run `command` under `timeout -k 5 N`, as on a device; we wait 10 s longer than that, then kill the group."""
        limit = timeout_s or self.command_timeout_s
        proc = await asyncio.create_subprocess_exec(
            *("timeout", "-k", "5", str(int(limit)), "sh", "-c", command),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=limit + 10)
        except BaseException:
            # Given up on (or cancelled with the whole deploy): nothing the command started may outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        status = proc.returncode if proc.returncode is not None else 255
        return Completed(status, stdout.decode(errors="replace"), stderr.decode(errors="replace"))

    async def put(self, local: Path, remote: str) -> int:
        """Copy one file (to `remote`.tmp, then renamed, so a name in place is a whole copy); returns bytes."""
        tmp = f"{remote}.tmp"
        await asyncio.to_thread(shutil.copyfile, local, tmp)
        os.replace(tmp, remote)
        return local.stat().st_size
