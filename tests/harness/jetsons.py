"""Stand-in Jetson devices: a real sshd per device, each in its own mount, UTS and pid namespaces.

See the package docstring (:mod:`tests.harness`) for the picture and a usage example. In short: a fleet owns one
holder process whose private mount namespace carries every device's size-limited deploy-root tmpfs (so a device's
"disk" outlives its restart and never appears in the host's mount table), and each device is
``nsenter --mount=HOLDER [--net=LINK] -- unshare --mount --uts --pid --fork --kill-child --mount-proc -- sh
target_init.sh``, whose pid 1 builds the device's filesystem view and then execs ``sshd -D -e``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from .inventory import DEFAULT_POLICY, write_inventory
from .network import DeviceLink, network_unavailable
from .procs import HarnessError, run, spawn, tool, wait_exec, wait_gone, which
from .specs import SIZE_RE, TargetSpec, default_specs
from .standins import StandIns

HERE = Path(__file__).resolve().parent
INIT_SCRIPT = HERE / "target_init.sh"
TOOLS_SCRIPT = HERE / "standin_tools.py"
LOOPBACK = "127.0.0.1"
USER = "root"
DEVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS = ("unshare", "nsenter", "mount", "ssh-keygen", "sshd")
PACKAGES = {"sshd": "openssh-server", "ssh-keygen": "openssh-client", "unshare": "util-linux", "nsenter": "util-linux"}


@cache
def harness_unavailable(network: bool = False) -> str | None:
    """Why stand-in devices (with private links, if `network`) cannot run here (a pytest skip reason), or None."""
    if not sys.platform.startswith("linux"):
        return "stand-in Jetsons need Linux namespaces"
    if os.geteuid() != 0:
        return "stand-in Jetsons need root (mount and pid namespaces, sshd running as root)"
    missing = [name for name in TOOLS if which(name) is None]
    if missing:
        packages = sorted({PACKAGES.get(name, name) for name in missing})
        return f"stand-in Jetsons need {', '.join(missing)}: apt-get install {' '.join(packages)}"
    probe = [tool("unshare"), "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]
    result = subprocess.run([*probe, "mount", "-t", "tmpfs", "tmpfs", "/tmp"], capture_output=True, text=True)
    if result.returncode:
        return f"unshare cannot create mount/pid namespaces here: {result.stderr.strip()}"
    return network_unavailable() if network else None


def _free_ports(count: int) -> list[int]:
    # All sockets stay open until every port is chosen, so the ports differ from each other.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class JetsonTarget:
    """One stand-in device. Connect with `connect_kwargs()` (asyncssh) or `ssh_argv()` (OpenSSH)."""

    user = USER

    def __init__(self, fleet: JetsonFleet, spec: TargetSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.dir = fleet.dir / spec.name
        """Host directory of this device: etc/upper (its /etc changes), control (stand-in knobs), sshd.log, ..."""
        self.host = LOOPBACK
        """Address to connect to: 127.0.0.1, or the device end of its private link."""
        self.port = 0
        self.standins = StandIns(self.dir / "control")
        self.link = DeviceLink(self.dir / "link.log") if spec.network else None
        """The device's private link (`shape`, `cut`, `heal`), when `TargetSpec.network` is set."""
        self._fleet = fleet
        self._proc: subprocess.Popen[bytes] | None = None
        self._init_pid: int | None = None
        self._log_offset = 0

    def __repr__(self) -> str:
        return f"<JetsonTarget {self.name} {self.host}:{self.port} {'running' if self.running else 'stopped'}>"

    @property
    def key_path(self) -> Path:
        """Client private key (ed25519) that the device's authorized_keys accepts."""
        return self._fleet.key_path

    @property
    def known_hosts_path(self) -> Path:
        """The fleet's known_hosts file (`[127.0.0.1]:PORT ssh-ed25519 ...` lines)."""
        return self._fleet.known_hosts_path

    @property
    def deploy_root(self) -> str:
        """Deploy root path on the device."""
        return self.spec.deploy_root

    @property
    def host_key_path(self) -> Path:
        """The device's ed25519 host key (private; `.pub` next to it)."""
        return self.dir / "etc/upper/ssh/standin/ssh_host_ed25519_key"

    @property
    def log_path(self) -> Path:
        """sshd's log (`-e`: errors, logins, disconnects) and any setup error, across restarts."""
        return self.dir / "sshd.log"

    @property
    def running(self) -> bool:
        """True while the device's namespace and sshd are up."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """Host pid of the device's pid 1, which is its sshd listener."""
        if not self.running or self._init_pid is None:
            raise HarnessError(f"{self.name}: not running")
        return self._init_pid

    @property
    def disk(self) -> Path:
        """Host path of the deploy root's contents; valid while the fleet is up, even when this device is stopped.

        It goes through /proc/PID/root of the fleet's holder, so an absolute symlink inside resolves on the host:
        follow only relative links through it (or use `run`).
        """
        return self._fleet.holder_root / str(self.dir / "disk").lstrip("/")

    def path(self, device_path: str) -> Path:
        """Host path of `device_path` as the running device sees it (via /proc/PID/root; same symlink caveat)."""
        return Path(f"/proc/{self.pid}/root") / device_path.lstrip("/")

    def run(
        self, command: str, *, input: str | None = None, timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run `sh -c command` as root inside the device's namespaces, bypassing SSH (for test setup and checks)."""
        argv = [tool("nsenter"), "-t", str(self.pid), "-m", "-u", "-p", "-n", "--", "/bin/sh", "-c", command]
        env = {"PATH": DEVICE_PATH, "HOME": "/root", "LANG": "C"}
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, env=env)
        if check and result.returncode:
            raise HarnessError(f"{self.name}: `{command}` exited {result.returncode}: {result.stderr.strip()}")
        return result

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `asyncssh.connect(**kwargs)`; the host key is checked against known_hosts."""
        return {
            "host": self.host,
            "port": self.port,
            "username": self.user,
            "client_keys": [str(self.key_path)],
            "known_hosts": str(self.known_hosts_path),
        }

    def ssh_argv(self, *remote: str) -> list[str]:
        """An OpenSSH command line for this device (batch mode, strict host key checking), then `remote`."""
        options = ["BatchMode=yes", "StrictHostKeyChecking=yes", f"UserKnownHostsFile={self.known_hosts_path}"]
        argv = ["ssh", "-i", str(self.key_path), "-p", str(self.port), "-F", "/dev/null"]
        for option in options:
            argv += ["-o", option]
        return [*argv, f"{self.user}@{self.host}", *remote]

    def known_hosts_line(self) -> str:
        """This device's known_hosts line (`[host]:port` unless the port is 22, as OpenSSH writes it)."""
        key_type, key = self.host_key_path.with_suffix(".pub").read_text().split()[:2]
        where = self.host if self.port == 22 else f"[{self.host}]:{self.port}"
        return f"{where} {key_type} {key}\n"

    def set_temperature(self, zone: str, celsius: float) -> None:
        """Set what thermal zone `zone` (its type, e.g. "gpu-thermal") reads, in millidegrees as the kernel shows it."""
        zones = list(self.spec.thermal_c)
        if zone not in zones:
            raise KeyError(f"{self.name}: no thermal zone {zone!r} (has {zones})")
        (self.dir / f"thermal/thermal_zone{zones.index(zone)}/temp").write_text(f"{round(celsius * 1000)}\n")

    def resize_disk(self, size: str) -> None:
        """Change the deploy root's tmpfs size (takes effect at once, also on a running device)."""
        if not SIZE_RE.fullmatch(size):
            raise ValueError(f"{self.name}: {size!r} is not a tmpfs size such as 64m")
        self._fleet.holder_run(f"mount -o remount,size={size} {shlex.quote(str(self.dir / 'disk'))}")

    def kill(self) -> None:
        """Power-cut the device: SIGKILL its pid 1, which takes down its whole pid namespace and every connection.

        The pid 1 is killed rather than the unshare above it (which ignores SIGTERM) so that unshare reaps it:
        killing unshare first would leave pid 1 as a zombie for the host's init, which may never reap it.
        """
        self._send_kill()
        self._reap()

    def restart(self) -> None:
        """Kill the device if it runs, then boot it again on the same address, with the same keys and deploy root."""
        self.kill()
        self._launch()
        if not self._wait_ready(time.monotonic() + self._fleet.start_timeout_s):
            raise HarnessError(f"{self.name}: port {self.port} was taken while the device was down")

    def _send_kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            # unshare is alive, so its child cannot have been reaped yet and the pid cannot have been reused.
            os.kill(self._init_pid or self._proc.pid, signal.SIGKILL)

    def _reap(self) -> None:
        if self._proc is not None:
            wait_gone(self._proc)
        self._proc = None
        self._init_pid = None

    def _prepare(self, client_pub: str) -> None:
        """Write the device's host-side files: /etc upper layer, device tree, thermal zones, stand-in knobs."""
        spec, board = self.spec, self.spec.board
        etc = self.dir / "etc/upper"
        for sub in ("etc/work", "disk", "control", "devicetree/base"):
            (self.dir / sub).mkdir(parents=True)
        (etc / "nv_tegra_release").write_text(f"{board.l4t}\n# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n")
        (etc / "hostname").write_text(f"{spec.hostname or spec.name}\n")
        (etc / "ssh/standin/authorized_keys").write_text(client_pub)
        serial = str(int(hashlib.sha256(spec.name.encode()).hexdigest()[:10], 16))
        tree = self.dir / "devicetree/base"
        (tree / "model").write_bytes(board.model.encode() + b"\0")
        (tree / "compatible").write_bytes(b"".join(c.encode() + b"\0" for c in board.compatible))
        (tree / "serial-number").write_bytes(serial.encode() + b"\0")
        for index, zone in enumerate(spec.thermal_c):
            (self.dir / f"thermal/thermal_zone{index}").mkdir(parents=True)
            (self.dir / f"thermal/thermal_zone{index}/type").write_text(f"{zone}\n")
        for zone, celsius in spec.thermal_c.items():
            self.set_temperature(zone, celsius)
        self.standins.set_packages(board.packages)
        self.standins.set_trtexec(version=board.tensorrt)

    def _write_sshd_config(self) -> None:
        config = f"""\
# sshd of stand-in Jetson {self.name} (tests/harness), run by target_init.sh inside the device's namespaces.
ListenAddress {self.host}:{self.port}
HostKey /etc/ssh/standin/ssh_host_ed25519_key
AuthorizedKeysFile /etc/ssh/standin/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The host dirs above /etc/ssh/standin (e.g. /tmp) may be group- or world-writable.
StrictModes no
PidFile none
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 64:30:128
MaxSessions 64
Subsystem sftp internal-sftp
"""
        (self.dir / "etc/upper/ssh/standin/sshd_config").write_text(config)

    def _launch(self) -> None:
        self._write_sshd_config()
        self.standins.reset_state()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {
            "PATH": DEVICE_PATH,
            "LANG": "C",
            "TARGET_DIR": str(self.dir),
            "TARGET_HOSTNAME": self.spec.hostname or self.spec.name,
            "DEPLOY_ROOT": self.spec.deploy_root,
            "HOST_DIRS": "\n".join(self.spec.host_dirs),
            "STANDIN_TOOL": str(self._fleet.standin_tool),
            "SSHD": tool("sshd"),
        }
        enter = [tool("nsenter"), f"--mount=/proc/{self._fleet.holder_pid}/ns/mnt"]
        if self.link is not None:
            enter.append(f"--net={self.link.netns}")
        namespaces = ["--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc"]
        argv = [*enter, "--", tool("unshare"), *namespaces, "--", "/bin/sh", str(INIT_SCRIPT)]
        self._proc = spawn(argv, env=env, log=self.log_path)

    def _new_log(self) -> str:
        with self.log_path.open("rb") as fh:
            fh.seek(self._log_offset)
            return fh.read().decode(errors="replace")

    def _wait_ready(self, deadline: float) -> bool:
        """Wait for "Server listening"; False when the port was taken (caller picks another), raise otherwise."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._init_pid is None:
                children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children")
                pids = children.read_text().split() if children.exists() else []
                self._init_pid = int(pids[0]) if pids else None
            log = self._new_log()
            if "Server listening on" in log and self._init_pid is not None:
                return True
            if self._proc.poll() is not None:
                self._reap()
                if "Address already in use" in log:
                    return False
                raise HarnessError(f"{self.name}: device did not start: {log.strip()[-2000:]}")
            time.sleep(0.005)
        self.kill()
        raise HarnessError(f"{self.name}: sshd not listening after {self._fleet.start_timeout_s} s: {self._new_log()}")


class JetsonFleet:
    """N stand-in devices with shared client credentials; a context manager that stops everything on exit.

    >>> with JetsonFleet(tmp_path, 3) as fleet:
    ...     fleet["orin-01"].port
    """

    def __init__(
        self, directory: Path, targets: int | Sequence[TargetSpec] = 3, *, start_timeout_s: float = 10.0
    ) -> None:
        specs = default_specs(targets) if isinstance(targets, int) else list(targets)
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique: {names}")
        self.dir = Path(directory).resolve()
        self.start_timeout_s = start_timeout_s
        self.targets = [JetsonTarget(self, spec) for spec in specs]
        self.key_path = self.dir / "client/id_ed25519"
        self.known_hosts_path = self.dir / "client/known_hosts"
        self.standin_tool = self.dir / "jetson-standin"
        self.start_s = 0.0
        """Seconds the last start() took, keys and all."""
        self._holder: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> JetsonFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, key: str | int) -> JetsonTarget:
        if isinstance(key, int):
            return self.targets[key]
        for target in self.targets:
            if target.name == key:
                return target
        raise KeyError(key)

    def __iter__(self) -> Iterator[JetsonTarget]:
        return iter(self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def holder_pid(self) -> int:
        """Host pid of the process whose mount namespace holds every device's deploy-root tmpfs."""
        if self._holder is None or self._holder.poll() is not None:
            raise HarnessError(f"{self.dir}: fleet not running")
        return self._holder.pid

    @property
    def holder_root(self) -> Path:
        """The host's files as the holder's mount namespace sees them (deploy-root tmpfs mounted)."""
        return Path(f"/proc/{self.holder_pid}/root")

    def holder_run(self, script: str) -> None:
        """Run a shell script inside the holder's mount namespace (mounts, remounts of the deploy roots)."""
        run([tool("nsenter"), f"--mount=/proc/{self.holder_pid}/ns/mnt", "--", "/bin/sh", "-ec", script])

    def start(self) -> JetsonFleet:
        """Start every device; on any failure, stop what was started and raise HarnessError."""
        reason = harness_unavailable(network=any(t.link for t in self.targets))
        if reason:
            raise HarnessError(reason)
        started = time.perf_counter()
        atexit.register(self.close)
        try:
            self._prepare()
            deadline = time.monotonic() + self.start_timeout_s
            holder = [tool("unshare"), "--mount", "--propagation", "private", "--", "sleep", "infinity"]
            self._holder = spawn(holder, log=self.dir / "holder.log")
            wait_exec(self._holder, "sleep", deadline, self.dir / "holder.log")
            self.holder_run("\n".join(self._disk_mount(t) for t in self.targets))
            for target in self.targets:
                if target.link is not None:
                    target.link.start(deadline)
                    target.host, target.port = target.link.device_ip, 22
            self._boot([t for t in self.targets if t.link is None], [t for t in self.targets if t.link])
            self.known_hosts_path.write_text("".join(t.known_hosts_line() for t in self if t.spec.in_known_hosts))
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def close(self) -> None:
        """Kill every device, its link and the holder, waiting until each process is gone. Safe to call twice."""
        for target in self.targets:
            target._send_kill()
        for target in self.targets:
            target._reap()
            if target.link is not None:
                target.link.close()
        if self._holder is not None:
            self._holder.kill()
            wait_gone(self._holder)
            self._holder = None
        atexit.unregister(self.close)

    def write_inventory(
        self,
        path: Path | None = None,
        *,
        names: Sequence[str] | None = None,
        defaults: Mapping[str, Any] | None = None,
        policy: Mapping[str, Any] | None = None,
        extra: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Path:
        """Write an inventory TOML for these devices (all, or `names`); return its path (default DIR/inventory.toml).

        `defaults` and `policy` override the [defaults] / [policy] tables; `extra[name]` adds keys to that target.
        """
        chosen = [self[name] for name in names] if names is not None else self.targets
        base = {
            "user": USER,
            "port": 22,
            "key": str(self.key_path),
            "known_hosts": str(self.known_hosts_path),
            "root": chosen[0].deploy_root if chosen else "/opt/edge",
            "service": "",
            "health_command": "",
            **(defaults or {}),
        }
        entries = []
        for target in chosen:
            entry: dict[str, Any] = {"name": target.name, "host": target.host, "port": target.port}
            if target.deploy_root != base["root"]:
                entry["root"] = target.deploy_root
            entries.append({**entry, **(extra or {}).get(target.name, {})})
        return write_inventory(path or self.dir / "inventory.toml", base, {**DEFAULT_POLICY, **(policy or {})}, entries)

    def _prepare(self) -> None:
        """Fleet dir, the stand-in tools script, client and host keys (generated in parallel), device files."""
        self.key_path.parent.mkdir(parents=True, exist_ok=False)
        interpreter = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
        self.standin_tool.write_text(f"#!{interpreter} -I\n" + TOOLS_SCRIPT.read_text())
        self.standin_tool.chmod(0o755)
        for target in self.targets:
            target.host_key_path.parent.mkdir(parents=True)
        keys = [(self.key_path, "fleet-client")] + [(t.host_key_path, t.name) for t in self.targets]
        keygen = [
            subprocess.Popen(
                [tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for path, comment in keys
        ]
        for proc, (path, _) in zip(keygen, keys, strict=True):
            _, stderr = proc.communicate(timeout=30)
            if proc.returncode:
                raise HarnessError(f"ssh-keygen for {path} failed: {stderr.decode().strip()}")
        client_pub = self.key_path.with_suffix(".pub").read_text()
        for target in self.targets:
            target._prepare(client_pub)

    def _disk_mount(self, target: JetsonTarget) -> str:
        return f"mount -t tmpfs -o size={target.spec.disk_size},mode=755 tmpfs {shlex.quote(str(target.dir / 'disk'))}"

    def _boot(self, loopback: list[JetsonTarget], linked: list[JetsonTarget], attempts: int = 3) -> None:
        """Start all devices in parallel; a loopback device whose port was taken meanwhile retries on a new one."""
        for target in linked:
            target._launch()
        pending = loopback
        for _ in range(attempts):
            for target, port in zip(pending, _free_ports(len(pending)), strict=True):
                target.port = port
                target._launch()
            deadline = time.monotonic() + self.start_timeout_s
            if linked and not all([t._wait_ready(deadline) for t in linked]):
                raise HarnessError(f"port 22 taken in a private network namespace: {[t.name for t in linked]}")
            linked = []
            pending = [t for t in pending if not t._wait_ready(deadline)]
            if not pending:
                return
        raise HarnessError(f"no free port for {[t.name for t in pending]} after {attempts} attempts")
