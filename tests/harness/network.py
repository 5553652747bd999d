"""Optional private link for a stand-in device: its own network namespace, joined to the host by a veth pair.

Addresses come from 10.213.0.0/16, one /30 per device (host end .1, device end .2). While any link exists the host
has a blackhole route for the whole range, so a packet for an address no device owns is dropped on the host instead
of leaving it. A device gets no default route: it reaches only the host end of its own link. IPv6 is off on both
ends, so nothing is sent unasked (router solicitations, DAD).

Faults: `shape()` puts a tbf qdisc on both ends (`tc ... tbf rate R burst B latency L`: bandwidth, no added delay:
there is no netem here), `cut()` takes the device's end down (packets are dropped silently, as with a pulled cable:
connections hang and time out), `heal()` brings it back.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from .procs import HarnessError, in_own_namespace, run, spawn, tool, wait_exec, wait_gone, which

RANGE = ipaddress.IPv4Network("10.213.0.0/16")
_claimed: set[int] = set()


def foreign_routes() -> list[str]:
    """Host routes into RANGE that this harness did not make: links must not shadow someone's real network."""
    routes = run([tool("ip"), "-4", "route", "show", "root", str(RANGE)]).splitlines()
    return [r.strip() for r in routes if r and not r.startswith("blackhole ") and " dev jet" not in r]


class _Blackhole:
    """The leak-guard route for RANGE, held while any link of this process exists."""

    def __init__(self) -> None:
        self.users = 0

    def acquire(self) -> None:
        if self.users == 0:
            foreign = foreign_routes()
            if foreign:
                raise HarnessError(f"{RANGE} is already routed on this host ({foreign[0]}): no private links")
            run([tool("ip"), "route", "replace", "blackhole", str(RANGE)], what="leak guard")
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            subprocess.run([tool("ip"), "route", "del", "blackhole", str(RANGE)], capture_output=True)


_GUARD = _Blackhole()


def _subnet(index: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network((int(RANGE.network_address) + 4 * index, 30))


def _claim() -> int:
    """A /30 index no link of this process holds and no host interface uses (another run's leftovers included)."""
    used = run([tool("ip"), "-4", "-o", "addr", "show"])
    for index in range(1, RANGE.num_addresses // 4):
        subnet = _subnet(index)
        taken = any(f" {address}/" in used for address in subnet)
        if index not in _claimed and not taken and not Path(f"/sys/class/net/jet{index}").exists():
            _claimed.add(index)
            return index
    raise HarnessError(f"no free /30 left in {RANGE}")


def network_unavailable() -> str | None:
    """Why private device links cannot be made here (skip reason), or None. Probes inside a throwaway namespace."""
    missing = [name for name in ("ip", "tc", "unshare", "nsenter") if which(name) is None]
    if missing:
        return f"private device links need {', '.join(missing)}: apt-get install iproute2 util-linux"
    probe = [
        tool("unshare"),
        "--net",
        "--",
        tool("ip"),
        "link",
        "add",
        "probe0",
        "type",
        "veth",
        "peer",
        "name",
        "probe1",
    ]
    result = subprocess.run(probe, capture_output=True, text=True)
    if result.returncode:
        return f"cannot create veth pairs here: {result.stderr.strip()}"
    foreign = foreign_routes()
    return f"{RANGE} is already routed on this host ({foreign[0]})" if foreign else None


@contextlib.contextmanager
def ip_forwarding() -> Iterator[None]:
    """The host forwards IPv4 between interfaces (so linked devices reach each other through it) while inside."""
    knob = Path("/proc/sys/net/ipv4/ip_forward")
    before = knob.read_text()
    knob.write_text("1\n")
    try:
        yield
    finally:
        knob.write_text(before)


class DeviceLink:
    """One device's network namespace and veth pair: host end `host_if` at `host_ip`, device end eth0 at `device_ip`."""

    def __init__(self, log: Path) -> None:
        self.index = 0
        self.host_if = ""
        self.host_ip = ""
        self.device_ip = ""
        self._log = log
        self._proc: subprocess.Popen[bytes] | None = None
        self._guarded = False

    @property
    def netns(self) -> str:
        """Path of the device's network namespace, for `nsenter --net=`."""
        if self._proc is None or self._proc.poll() is not None:
            raise HarnessError(f"{self.host_if or 'link'}: not up")
        return f"/proc/{self._proc.pid}/ns/net"

    def start(self, deadline: float) -> None:
        """Create the namespace (held by a sleeping process), the veth pair and the addresses."""
        self.index = _claim()
        subnet = _subnet(self.index)
        self.host_if, self.host_ip, self.device_ip = f"jet{self.index}", str(subnet[1]), str(subnet[2])
        _GUARD.acquire()
        self._guarded = True
        self._proc = spawn([tool("unshare"), "--net", "--", "sleep", "infinity"], log=self._log)
        wait_exec(self._proc, "sleep", deadline, self._log)
        # Never configure interfaces in a namespace that turns out to be the host's own.
        if not in_own_namespace(self._proc.pid, "net"):
            raise HarnessError(f"{self.host_if}: process {self._proc.pid} is not in its own network namespace")
        host = [
            f"link add {self.host_if} type veth peer name eth0 netns {self._proc.pid}",
            f"addr add {self.host_ip}/30 dev {self.host_if}",
        ]
        run([tool("ip"), "-batch", "-"], input="\n".join(host) + "\n", what=self.host_if)
        Path(f"/proc/sys/net/ipv6/conf/{self.host_if}/disable_ipv6").write_text("1\n")
        run([tool("ip"), "link", "set", self.host_if, "up"], what=self.host_if)
        self.in_device(
            "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6; ip link set lo up; "
            f"ip addr add {self.device_ip}/30 dev eth0; ip link set eth0 up"
        )
        self._wait_up(deadline)

    def in_device(self, script: str) -> str:
        """Run a shell script in the device's network namespace only (the host's files, the device's network)."""
        return run([tool("nsenter"), f"--net={self.netns}", "--", "/bin/sh", "-ec", script], what=self.host_if)

    def shape(self, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """Limit both directions to `rate` (tc syntax: 40mbit) with a token bucket."""
        qdisc = f"qdisc replace dev {{dev}} root tbf rate {rate} burst {burst} latency {latency}"
        run([tool("tc"), *qdisc.format(dev=self.host_if).split()], what=self.host_if)
        self.in_device("tc " + qdisc.format(dev="eth0"))

    def unshape(self) -> None:
        """Remove the bandwidth limit from both ends."""
        subprocess.run([tool("tc"), "qdisc", "del", "dev", self.host_if, "root"], capture_output=True)
        self.in_device("tc qdisc del dev eth0 root 2>/dev/null || true")

    def cut(self) -> None:
        """Take the device's end down: every packet either way is dropped, connections hang."""
        self.in_device("ip link set eth0 down")

    def heal(self) -> None:
        """Bring the device's end back up; returns once both ends pass traffic again."""
        self.in_device("ip link set eth0 up")
        self._wait_up(time.monotonic() + 5)

    def _wait_up(self, deadline: float) -> None:
        # The kernel's link watcher marks a veth end operational (and attaches its qdisc) up to a second after
        # `ip link set up`; until then packets are dropped.
        host_state = Path(f"/sys/class/net/{self.host_if}/operstate")
        while host_state.read_text().strip() != "up" or "state UP" not in self.in_device("ip -o link show eth0"):
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.host_if}: link not up")
            time.sleep(0.01)

    def close(self) -> None:
        """Destroy the namespace, wait for the kernel to remove the veth pair (it does so asynchronously)."""
        if self._proc is not None:
            self._proc.kill()
            wait_gone(self._proc)
            self._proc = None
            deadline = time.monotonic() + 5
            while Path(f"/sys/class/net/{self.host_if}").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        if self._guarded:
            _GUARD.release()
            self._guarded = False
        _claimed.discard(self.index)
