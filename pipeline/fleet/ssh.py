"""SSH to one device with asyncssh: verified host keys, keepalives, and remote commands that cannot outlive us.

A client-side timeout does not stop a remote process (there is no PTY), so every command runs under the
device's own `timeout -k 5 N`. Transfer and connection failures arrive as OSError subclasses, asyncssh.Error and
asyncio.TimeoutError: `FAILURES` names all three so callers catch them in one place
(docs/ssh-and-devices.md#errors-from-asyncssh, #remote-commands-outlive-client-timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncssh

from pipeline.files import atomic_path
from pipeline.fleet.inventory import SshTarget

FAILURES = (OSError, asyncssh.Error, asyncio.TimeoutError)
CONNECT_TIMEOUT_S = 15
KEEPALIVE_S = 5
"""Seconds without a word from the device before the controller sends it a keepalive."""
LINK_TIMEOUT_S = 15
"""Seconds a device may stay silent before its connection counts as lost, unless the caller says otherwise: three
unanswered keepalives, what a deploy or a check waits. The SSH training job passes `train.link_timeout_s`, long
enough to ride out a WiFi blackout."""


class Refused(Exception):
    """The controller will not log in: the device's host key is not trusted, or the controller's own key is unusable.
    The target is reported REFUSED with the reason; a retry cannot cure it."""


class HostKeyRefused(Refused):
    """The device's host key is not in known_hosts (and trust on first use is off), or it changed."""


class ClientKeyRefused(Refused):
    """The private key the inventory names cannot be read: missing, garbage, or encrypted (no passphrase here)."""


@dataclass(frozen=True)
class Completed:
    """A finished remote command."""

    exit_status: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """True when it exited 0."""
        return self.exit_status == 0

    def tail(self) -> str:
        """Last line of stderr (else stdout): the one-line reason shown for a failed command."""
        lines = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return lines[-1] if lines else f"exit status {self.exit_status}"


def remote_command(command: str, timeout_s: int) -> str:
    """`command` as run on the device: under `timeout -k 5 N`, in its own `sh -c` so pipes and `cd` stay inside."""
    return f"timeout -k 5 {int(timeout_s)} sh -c {shlex.quote(command)}"


class Device:
    """An open SSH connection to one target: `async with Device(target) as dev: await dev.run(...)`."""

    def __init__(self, target: SshTarget, command_timeout_s: int = 300, link_timeout_s: int = LINK_TIMEOUT_S) -> None:
        self.target = target
        self.command_timeout_s = command_timeout_s
        self.link_timeout_s = link_timeout_s
        """Seconds the device may be silent before the connection is closed as lost (see `connect`)."""
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._sftp_starting = asyncio.Lock()  # puts run concurrently (fleet.upload): one SFTP session for all

    async def __aenter__(self) -> Device:
        self._conn = await connect(self.target, self.link_timeout_s)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            self._conn.close()
            # A dead peer never answers the close: don't wait for it longer than a moment.
            with contextlib.suppress(FAILURES):
                await asyncio.wait_for(self._conn.wait_closed(), timeout=2)
            self._conn = None

    @property
    def conn(self) -> asyncssh.SSHClientConnection:
        """The live connection."""
        if self._conn is None:
            raise RuntimeError(f"{self.target.name}: not connected")
        return self._conn

    async def run(self, command: str, timeout_s: int | None = None, stdin: str | None = None) -> Completed:
        """Run `command` on the device under a remote timeout; the client waits 10 s longer than that."""
        limit = timeout_s or self.command_timeout_s
        result = await asyncio.wait_for(
            self.conn.run(remote_command(command, limit), check=False, input=stdin), timeout=limit + 10
        )
        status = result.exit_status if result.exit_status is not None else 255
        return Completed(status, _text(result.stdout), _text(result.stderr))

    async def start(self, command: str, timeout_s: int) -> asyncssh.SSHClientProcess[str]:
        """Start `command` under a remote timeout and return at once: its output streams, its stdin stays open."""
        return await self.conn.create_process(remote_command(command, timeout_s), encoding="utf-8", errors="replace")

    async def get(self, remote: str, local: Path) -> int:
        """Download one file to `local` durably: into a temp file beside it, fsynced, renamed when whole, the directory
        fsynced (a checkpoint copied back is trusted as soon as it has its name); returns its size."""
        sftp = await self._sftp_client()
        with atomic_path(local) as tmp:
            await sftp.get(remote, str(tmp))
        return local.stat().st_size

    async def put(self, local: Path, remote: str) -> int:
        """Upload one file (to `remote`.tmp, then renamed, so a name in place is a whole upload); returns bytes."""
        sftp = await self._sftp_client()
        tmp = f"{remote}.tmp"
        await sftp.put(str(local), tmp)
        await sftp.posix_rename(tmp, remote)
        return local.stat().st_size

    async def _sftp_client(self) -> asyncssh.SFTPClient:
        async with self._sftp_starting:
            if self._sftp is None:
                self._sftp = await self.conn.start_sftp_client()
        return self._sftp


def quiet_lost_connections() -> None:
    """Keep the running loop from printing tracebacks for transfer errors that were already reported.

    When a link dies mid-transfer, asyncssh's parallel SFTP workers end with ConnectionLost that nobody awaits
    (the upload call itself raised, and the target was marked failed); asyncio would print each at exit.
    """
    loop = asyncio.get_running_loop()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), FAILURES) and "never retrieved" in context.get("message", ""):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


async def connect(target: SshTarget, link_timeout_s: int = LINK_TIMEOUT_S) -> asyncssh.SSHClientConnection:
    """Open a connection with the host key checked against `target.known_hosts` (or trusted on first use), closed as
    lost once the device has been silent for `link_timeout_s` (to within one keepalive interval more)."""
    options = {
        "host": target.host,
        "port": target.port,
        "username": target.user,
        "client_keys": [client_key(target)],
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalive_interval": KEEPALIVE_S,
        "keepalive_count_max": max(1, math.ceil(link_timeout_s / KEEPALIVE_S)),
        "agent_path": None,
        "config": [],
    }
    listed = _listed(target)
    if listed or not target.trust_on_first_use:
        try:
            return await asyncssh.connect(**options, known_hosts=str(target.known_hosts))
        except asyncssh.HostKeyNotVerifiable as err:
            why = "does not match the key known_hosts lists" if listed else "is not in known_hosts"
            raise HostKeyRefused(
                f"host key of {target.host}:{target.port} {why} ({target.known_hosts}): {err}"
            ) from None
    conn = await asyncssh.connect(**options, known_hosts=None)
    _remember(target, conn)
    return conn


def client_key(target: SshTarget) -> asyncssh.SSHKey:
    """The target's private key, loaded before connecting so that a bad key is a reason, not a traceback."""
    try:
        return asyncssh.read_private_key(str(target.key))
    except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as err:
        raise ClientKeyRefused(f"key {target.key}: not a usable private key: {err}") from None
    except OSError as err:
        raise ClientKeyRefused(f"key {target.key}: cannot read it: {err.strerror}") from None


def _where(target: SshTarget) -> str:
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def _listed(target: SshTarget) -> bool:
    """True when known_hosts has any key for this host and port (so a mismatch is refused even with TOFU)."""
    if not target.known_hosts.is_file():
        return False
    trusted, ca, revoked, *_ = asyncssh.read_known_hosts(str(target.known_hosts)).match(
        target.host, target.host, target.port
    )
    return bool(trusted or ca or revoked)


def _remember(target: SshTarget, conn: asyncssh.SSHClientConnection) -> None:
    key = conn.get_server_host_key()
    if key is None:
        return
    line = f"{_where(target)} {key.export_public_key('openssh').decode().strip()}\n"
    target.known_hosts.parent.mkdir(parents=True, exist_ok=True)
    with target.known_hosts.open("a") as fh:
        fh.write(line)
