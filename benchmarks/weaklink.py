"""An emulated weak network link (default 100 Mbit/s, 20 ms each way) between two Linux network namespaces.

    python benchmarks/weaklink.py --check [--rate 100mbit] [--delay-ms 20] [--mtu 65000] [--seconds 4]

Namespaces A (10.214.0.1) and B (10.214.0.2) are joined only to each other, by one veth pair named eth0 on both
sides and limited by `tc tbf` at both ends. This kernel has no netem, so the delay comes from a shim per namespace:
the route to the peer's /32 points into a TUN device, the shim reads each IP packet from it, holds it `delay_ms`
and then sends it out of eth0 in an Ethernet frame to the peer's MAC (an AF_PACKET send goes through the qdisc, so
tbf still applies). The peer's kernel delivers it locally; its replies take its own shim the other way.

Training across it: start `pipeline train --nnodes 2 ... --local-addr <own address>` in each namespace (`argv()`)
with `GLOO_SOCKET_IFNAME=eth0`. The hostname resolves to neither address, so without `--local-addr` no node hosts
the rendezvous store and the master address advertised is unreachable (benchmarks/train_compression.py does this).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import json
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ADDRESSES = ("10.214.0.1", "10.214.0.2")  # a /30 on no host interface (10.213/16 is another harness's)
MACS = ("02:00:0a:d6:00:01", "02:00:0a:d6:00:02")  # fixed, so a shim knows its peer's MAC without asking
TUN, TUNSETIFF, IFF_TUN, IFF_NO_PI = "tun0", 0x400454CA, 0x0001, 0x1000
SO_SNDBUFFORCE = 32  # not in the socket module; lets root exceed net.core.wmem_max


def unavailable() -> str | None:
    """Why the link cannot be made on this machine (for a skip message), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    if missing := [tool for tool in ("ip", "tc", "sysctl") if shutil.which(tool) is None]:
        return f"{', '.join(missing)} not installed (iproute2, procps)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the delay shim needs a TUN device)"
    return None


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc.stdout


def tun_lines(mtu: int, routes: list[str], src: str) -> str:
    """`ip -batch` lines that make tun0 and route `routes` (CIDR) into it with source address `src`: whatever is
    sent there reaches the shim instead of eth0. Run them in the namespace the shim will run in."""
    lines = [f"tuntap add dev {TUN} mode tun", f"link set {TUN} mtu {mtu} up"]
    return "\n".join([*lines, *(f"route replace {route} dev {TUN} src {src}" for route in routes)]) + "\n"


def start_shim(prefix: list[str], peer_mac: str, own_mac: str, delay_ms: float) -> subprocess.Popen[str]:
    """Start `shim()` under `prefix` (the argv that enters its namespace: `ip netns exec NS`, `nsenter --net=P --`)
    and wait until it holds tun0; stop it with `stop_shim()`."""
    cmd = [*prefix, sys.executable, os.path.abspath(__file__), "shim", peer_mac, own_mac, str(delay_ms)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline() != "ready\n":  # type: ignore[union-attr]
        proc.kill()
        raise RuntimeError(f"delay shim ({' '.join(prefix)}) did not start (exit {proc.wait()})")
    return proc


def stop_shim(proc: subprocess.Popen[str]) -> None:
    """Stop a shim from `start_shim()`: closing its stdin is its cue to exit; killed if it does not within 5 s."""
    proc.stdin.close()  # type: ignore[union-attr]
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class WeakLink:
    """Context manager: builds the namespaces, the link and the shims on entry; removes all of it on exit."""

    addresses: tuple[str, str] = ADDRESSES
    interface: str = "eth0"

    def __init__(self, rate: str = "100mbit", delay_ms: float = 20.0, queue_ms: float = 50.0, mtu: int = 65000) -> None:
        """`rate` in tc's units, `delay_ms` added each way, `queue_ms` of tbf queue before drops. The large MTU keeps
        the shims to a few hundred packets/s at 100 Mbit/s (Python's per-packet cost), at some cost in realism."""
        self.rate, self.delay_ms, self.queue_ms, self.mtu = rate, delay_ms, queue_ms, mtu
        self.namespaces = (f"weaklink-{os.getpid()}-a", f"weaklink-{os.getpid()}-b")
        self.shims: list[subprocess.Popen[str]] = []

    def argv(self, side: int, cmd: list[str]) -> list[str]:
        """`cmd` to run inside namespace `side` (0 = A, 1 = B)."""
        return ["ip", "netns", "exec", self.namespaces[side], *cmd]

    def shim_cpu(self) -> list[float]:
        """CPU seconds (user + system) each shim has used so far, A first."""
        return [cpu_seconds(p.pid) for p in self.shims]

    def __enter__(self) -> WeakLink:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for name in _run("ip", "netns", "list").split():  # leftovers of a run that was killed before it cleaned up
            if (m := re.fullmatch(r"weaklink-(\d+)-[ab]", name)) and not os.path.exists(f"/proc/{m[1]}"):
                _remove(name)
        # Set before the devices exist, so eth0 and tun0 inherit them: no IPv6 (no stray router solicitations),
        # no reverse-path filter (packets from the peer arrive on eth0 but the route back is via tun0).
        sysctls = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
                   "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]  # fmt: skip
        for side, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run(*self.argv(side, ["sysctl", "-qw", *sysctls]))
        mtu, (a, b) = str(self.mtu), self.namespaces
        _run("ip", "link", "add", "eth0", "netns", a, "address", MACS[0], "mtu", mtu,
             "type", "veth", "peer", "name", "eth0", "netns", b, "address", MACS[1], "mtu", mtu)  # fmt: skip
        for side, ns in enumerate(self.namespaces):
            ip = ("ip", "-n", ns)
            _run(*ip, "link", "set", "lo", "up")
            # noprefixroute: no route to the peer via eth0, so nothing can bypass the delay shim.
            _run(*ip, "addr", "add", f"{ADDRESSES[side]}/30", "dev", "eth0", "noprefixroute")
            _run(*ip, "link", "set", "eth0", "up")
            # burst must hold the largest frame (tbf drops bigger ones); latency sizes its queue.
            _run("tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", self.rate,
                 "burst", str(2 * (self.mtu + 14)), "latency", f"{self.queue_ms}ms")  # fmt: skip
            tun = tun_lines(self.mtu, [f"{ADDRESSES[1 - side]}/32"], ADDRESSES[side])
            subprocess.run([*ip, "-batch", "-"], input=tun, text=True, check=True)
            self.shims.append(start_shim(self.argv(side, []), MACS[1 - side], MACS[side], self.delay_ms))

    def close(self) -> None:
        """Stop the shims and anything else still running in the namespaces, then remove the namespaces."""
        for proc in self.shims:
            stop_shim(proc)
        self.shims = []
        for ns in self.namespaces:
            _remove(ns)


def _remove(ns: str) -> None:
    if ns not in _run("ip", "netns", "list").split():
        return
    for pid in _run("ip", "netns", "pids", ns).split():  # processes started in it (argv()) that outlived it
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    # `ip netns del` frees devices asynchronously; deleting them first is synchronous (the veth takes its peer
    # with it), so nothing of this link is left when the next one is built.
    for dev in (TUN, "eth0"):
        subprocess.run(["ip", "-n", ns, "link", "del", dev], capture_output=True)
    _run("ip", "netns", "del", ns)


def shim(peer_mac: str, own_mac: str, delay_ms: float) -> None:
    """Run inside a namespace: send each packet from tun0 out of eth0 to `peer_mac`, `delay_ms` late, in order."""
    tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH", TUN.encode(), IFF_TUN | IFF_NO_PI))
    out = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: sends only, receives nothing
    out.bind(("eth0", 0))
    out.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 64 << 20)  # tbf's queue limit drops, not our send buffer
    header = bytes.fromhex(peer_mac.replace(":", "") + own_mac.replace(":", "")) + b"\x08\x00"  # IPv4
    sel = selectors.DefaultSelector()
    sel.register(tun, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    held: collections.deque[tuple[float, bytes]] = collections.deque()  # one delay for all: FIFO keeps the order
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(max(0.0, held[0][0] - time.monotonic()) if held else None):
            if key.fileobj is sys.stdin:  # closed: the parent is done (or gone)
                return
            with contextlib.suppress(BlockingIOError):
                while packet := os.read(tun, 1 << 16):
                    if packet[0] >> 4 == 4:
                        held.append((time.monotonic() + delay_ms / 1000, packet))
        while held and held[0][0] <= time.monotonic():
            try:
                out.send(header + held.popleft()[1])
            except OSError as e:  # ENOBUFS: tbf's queue was full and dropped it, as a congested link does
                if e.errno != errno.ENOBUFS:
                    raise


def _send_for(conn: socket.socket, seconds: float) -> int:
    chunk, end, sent = bytes(1 << 20), time.monotonic() + seconds, 0
    while time.monotonic() < end:
        sent += conn.send(chunk)
    return sent


def serve(address: str, port: int) -> None:
    """Run in B for --check: per connection, echo ("e"), read what A sends ("u") or send to A ("d"), then close."""
    server = socket.create_server((address, port))
    print("ready", flush=True)
    while True:
        with server.accept()[0] as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = conn.recv(8, socket.MSG_WAITALL).decode()  # mode, then seconds
            if header[0] == "d":
                _send_for(conn, float(header[1:]))
            while data := conn.recv(1 << 20):  # "e" and "u" until A shuts its side
                if header[0] == "e":
                    conn.sendall(data)


def client(mode: str, address: str, port: int, seconds: float) -> None:
    """Run in A for --check: print RTTs of 64-byte exchanges ("e"), or throughput to B ("u") or from B ("d")."""
    conn = socket.create_connection((address, port), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.monotonic()
    conn.sendall(f"{mode}{seconds:7.2f}".encode())
    if mode == "e":
        rtts = []
        for _ in range(21):  # the first is a warm-up, left out
            start = time.perf_counter()
            conn.sendall(bytes(64))
            if len(conn.recv(64, socket.MSG_WAITALL)) != 64:
                raise RuntimeError("echo connection closed")
            rtts.append((time.perf_counter() - start) * 1000)
        print(json.dumps({"rtt_ms": rtts[1:]}))
        return
    total = _send_for(conn, seconds) if mode == "u" else 0
    conn.shutdown(socket.SHUT_WR)
    while data := conn.recv(1 << 20):  # "d": B's bytes; "u": nothing, B closes once it has read all of ours
        total += len(data)
    print(json.dumps({"bytes": total, "seconds": time.monotonic() - start}))  # request to last byte: +1 RTT


def measure_path(a: list[str], b: list[str], address: str, seconds: float, port: int = 5201) -> dict[str, Any]:
    """RTTs (ms) of 64-byte exchanges and bulk throughput (Mbit/s) both ways between two places, A and B, given as
    the argv prefixes that run a command there (`[]`: here); B serves at `address`."""
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen([*b, *me, "serve", address, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline() != "ready\n":  # type: ignore[union-attr]
            raise RuntimeError("test server in B did not start")

        def client(mode: str) -> dict[str, Any]:
            return json.loads(_run(*a, *me, "client", mode, address, str(port), str(seconds)))

        rtt = client("e")["rtt_ms"]
        up, down = client("u"), client("d")
    finally:
        server.kill()
        server.wait()
    mbit = [r["bytes"] * 8 / r["seconds"] / 1e6 for r in (up, down)]
    return {"rtt_ms": rtt, "a_to_b_mbit": mbit[0], "b_to_a_mbit": mbit[1]}


def measure(link: WeakLink, seconds: float, port: int = 5201) -> dict[str, Any]:
    """`measure_path()` between A and B, plus shim CPU (share of a core) over the whole measurement and tbf's
    counters at both ends (proof that the traffic crossed it)."""
    cpu_before, start = link.shim_cpu(), time.monotonic()
    m = measure_path(link.argv(0, []), link.argv(1, []), ADDRESSES[1], seconds, port)
    cpu = [(b - a) / (time.monotonic() - start) for a, b in zip(cpu_before, link.shim_cpu(), strict=True)]
    # tbf's counters ("Sent N bytes M pkt (dropped D, ...")
    tbf = [_run("tc", "-s", "-n", ns, "qdisc", "show", "dev", "eth0").split("\n")[1] for ns in link.namespaces]
    return {**m, "shim_cpu": cpu, "tbf": tbf}


def check(rate: str, delay_ms: float, mtu: int, seconds: float) -> None:
    """Build the link, measure it, print the numbers, tear it down."""
    with WeakLink(rate, delay_ms, mtu=mtu) as link:
        m = measure(link, seconds)
    rtt = m["rtt_ms"]
    print(f"weaklink: {rate}, {delay_ms:g} ms each way, MTU {mtu}, {ADDRESSES[0]} (A) <-> {ADDRESSES[1]} (B)")
    print(f"  RTT     median {statistics.median(rtt):.2f} ms of {len(rtt)} (min {min(rtt):.2f}, max {max(rtt):.2f})")
    print(f"  A -> B  {m['a_to_b_mbit']:.1f} Mbit/s\n  B -> A  {m['b_to_a_mbit']:.1f} Mbit/s")
    print(f"  shim CPU while measuring: A {m['shim_cpu'][0]:.1%}, B {m['shim_cpu'][1]:.1%} of a core")
    print(f"  tbf A: {m['tbf'][0].strip()}\n  tbf B: {m['tbf'][1].strip()}")


def main(argv: list[str] | None = None) -> int:
    """CLI: `--check` for people; `shim`, `serve` and `client` are what runs inside the namespaces."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("shim", "serve", "client"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent, which stops these itself
        a = argv[1:]
        {"shim": lambda: shim(a[0], a[1], float(a[2])), "serve": lambda: serve(a[0], int(a[1])),
         "client": lambda: client(a[0], a[1], int(a[2]), float(a[3]))}[argv[0]]()  # fmt: skip
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", required=True, help="build the link, measure, tear down")
    parser.add_argument("--rate", default="100mbit", help="tc rate (default 100mbit)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added each way (default 20)")
    parser.add_argument("--mtu", type=int, default=65000, help="of eth0 and tun0 (default 65000)")
    parser.add_argument("--seconds", type=float, default=4.0, help="of each bulk run (default 4)")
    args = parser.parse_args(argv)
    if reason := unavailable():
        print(f"weaklink: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the with-block still tears everything down
    try:
        check(args.rate, args.delay_ms, args.mtu, args.seconds)
    except RuntimeError as e:
        print(f"weaklink: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
