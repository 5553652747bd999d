"""Syscall traces that show whether a command publishes data durably.

`strace -f -y` records the fsyncs, syncs, renames, links and symlinks of a command (or of a running process and all
it starts, such as a stand-in device's sshd: `attached`), with the path behind every descriptor. `unsynced_publishes`
then reads the trace in order. A rename into the checked root publishes what it renames, and what it publishes must
already be on disk:

- a file: its data was fsynced (by name) before the rename, or a `sync()` ran after it got that name;
- a directory (a release's `.part`, say): every file put into it by a rename or a link and still there afterwards
  was fsynced (or covered by a `sync()`) after it got its name, or arrived by a rename that published its data
  durably (fsynced under its temp name first), and the directory itself was fsynced after its last new entry;
- a symlink switched into place (`current`): the directory it points at, when the trace renamed that directory into
  place, had that rename synced (its parent fsynced, or a `sync()`) before the switch.

And every publish is itself made durable before the trace ends: its parent directory fsynced after the rename, or a
`sync()`. `sync()` and `syncfs()` count as covering everything written before them (the checked trees are each on
one filesystem). Writes themselves are not traced: a file written in place, never renamed or linked, is known only by
its fsync.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

TRACED = "fsync,fdatasync,sync,syncfs,rename,renameat,renameat2,link,linkat,symlink,symlinkat"
_DIRFD = r"(?:AT_FDCWD|\d+)(?:<(?P<{0}>[^>]*)>)?"
_STR = r'"(?P<{0}>(?:[^"\\]|\\.)*)"'
_CALLS = {
    "fsync": re.compile(r"^f(?:data)?sync\(\d+<(?P<path>[^>]*)>\)"),
    "sync": re.compile(r"^sync(?:fs)?\((?:\d+(?:<[^>]*>)?)?\)"),
    "rename": re.compile(rf"^(?:rename|link)\({_STR.format('src')}, {_STR.format('dst')}\)"),
    "renameat": re.compile(
        rf"^(?:renameat2?|linkat)\({_DIRFD.format('sdir')}, {_STR.format('src')}, {_DIRFD.format('ddir')}, "
        rf"{_STR.format('dst')}"
    ),
    "symlink": re.compile(rf"^symlink\({_STR.format('target')}, {_STR.format('dst')}\)"),
    "symlinkat": re.compile(rf"^symlinkat\({_STR.format('target')}, {_DIRFD.format('ddir')}, {_STR.format('dst')}\)"),
}
_LINE = re.compile(r"^(?P<pid>\d+) +(?P<call>.*)$")
_UNFINISHED = " <unfinished ...>"
_RESUMED = re.compile(r"^<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)$")


def strace(cmd: Sequence[str], log: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `cmd` under strace, following children, with the calls `TRACED` names in `log`; skips without strace.

    `--seccomp-bpf` stops the command only at the traced calls, not at every one (importing torch under plain
    `strace -f` took 25 s here, 10 s with it); it needs a command strace starts, so :func:`attached` goes without."""
    return subprocess.run([*_strace_argv(log, seccomp=True), *cmd], **kwargs)  # type: ignore[call-overload]


@contextmanager
def attached(pid: int, log: Path, enter: Sequence[str] = (), log_there: str = "") -> Iterator[None]:
    """Trace the running process `pid` and everything it starts from now on (`strace -f -p`) until the block ends.

    `enter` is a prefix that runs strace elsewhere, e.g. `nsenter -t N -m -p` into a stand-in device, so that the
    paths it prints are the device's own (`pid` is then the pid as seen there, and `log_there` the path of `log`).
    """
    argv = [*enter, *_strace_argv(Path(log_there or log), quiet=False), "-p", str(pid)]
    said = log.with_name(f"{log.name}.stderr")
    with said.open("wb") as err:
        # SIGINT is how strace is told to detach: a job started with `&` inherits it ignored, and so would strace.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    deadline = time.monotonic() + 10
    while b"attached" not in said.read_bytes():  # "Process N attached": from here on, every call is in the log
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"strace did not attach to {pid}: {said.read_text()}")
        time.sleep(0.01)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # detaches and flushes the log
        proc.wait(timeout=30)


def _strace_argv(log: Path, quiet: bool = True, seccomp: bool = False) -> list[str]:
    exe = shutil.which("strace")
    if exe is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace; `make test` installs it as root)")
    flags = ["-f", *(["--seccomp-bpf"] if seccomp else []), *(["-qq"] if quiet else []), "-y"]
    return [exe, *flags, "-e", f"trace={TRACED}", "-e", "signal=none", "-o", str(log)]


_NOWHERE = PurePosixPath()


@dataclass(frozen=True)
class _Event:
    kind: str  # fsync, sync, rename, link, symlink
    path: PurePosixPath = _NOWHERE  # what was fsynced, or the new name
    src: PurePosixPath = _NOWHERE  # a rename's or link's old name
    target: str = ""  # a symlink's content


def _events(log: Path) -> list[_Event]:
    """The successful calls of the trace in the order they completed (a call strace split in two, because another
    process ran meanwhile, counts where it finished)."""
    pending: dict[str, str] = {}
    events = []
    for line in log.read_text().splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, call = match["pid"], match["call"]
        if call.endswith(_UNFINISHED):
            pending[pid] = call.removesuffix(_UNFINISHED)
            continue
        if resumed := _RESUMED.match(call):
            call = pending.pop(pid, resumed["name"] + "(") + resumed["rest"]
        if call.rstrip().endswith("= 0") and (event := _event(call)) is not None:
            events.append(event)
    return events


def _event(call: str) -> _Event | None:
    for kind, pattern in _CALLS.items():
        if (m := pattern.match(call)) is None:
            continue
        if kind in ("fsync", "sync"):
            return _Event(kind, PurePosixPath(m["path"]) if kind == "fsync" else _NOWHERE)
        groups = m.groupdict()
        dst = _resolve(groups.get("ddir"), m["dst"])
        if kind.startswith("symlink"):
            return _Event("symlink", dst, target=m["target"])
        name = "link" if call.startswith("link") else "rename"
        return _Event(name, dst, src=_resolve(groups.get("sdir"), m["src"]))
    return None


def _resolve(directory: str | None, path: str) -> PurePosixPath:
    """`path` as an absolute path when the trace says what it is relative to (`AT_FDCWD</cwd>`, `3</dir>`)."""
    return PurePosixPath(os.path.normpath(PurePosixPath(directory or "") / path))


class _Trace:
    """What the trace did so far: when each path got its name, each fsync, each sync."""

    def __init__(self) -> None:
        self.placed: dict[PurePosixPath, int] = {}
        self.arrived_synced: set[PurePosixPath] = set()
        """Files whose data was fsynced by their former name before the rename that gave them their name."""
        self.symlinks: dict[PurePosixPath, str] = {}
        self.fsyncs: dict[PurePosixPath, list[int]] = {}
        self.syncs: list[int] = []

    def durable(self, path: PurePosixPath, after: int, before: int) -> bool:
        """An fsync of `path`, or a sync(), between the two events."""
        return any(after < i < before for i in self.fsyncs.get(path, []) + self.syncs)

    def under(self, directory: PurePosixPath) -> dict[PurePosixPath, int]:
        return {p: i for p, i in self.placed.items() if p.is_relative_to(directory) and p != directory}

    def synced_since_placed(self, path: PurePosixPath, at: int) -> bool:
        """The data under `path` was on disk by event `at`: fsynced after it got its name, or on arrival."""
        return path in self.arrived_synced or self.durable(path, self.placed.get(path, -1), at)

    def move(self, src: PurePosixPath, dst: PurePosixPath, at: int) -> None:
        self.arrived_synced.discard(dst)
        # Only an fsync of the file itself: a sync() before the rename may predate the file (its creation is untraced).
        if any(self.placed.get(src, -1) < i < at for i in self.fsyncs.get(src, [])):
            self.arrived_synced.add(dst)
        for path in [src, *self.under(src)]:
            moved = dst / path.relative_to(src)
            if path in self.placed:
                self.placed[moved] = self.placed.pop(path)
            if path in self.symlinks:
                self.symlinks[moved] = self.symlinks.pop(path)
            if path in self.arrived_synced:
                self.arrived_synced.discard(path)
                self.arrived_synced.add(moved)
        self.placed[dst] = at


def unsynced_publishes(log: Path, root: Path, disk: Path | None = None) -> list[str]:
    """Every publish into `root` (see the module docstring) that was not durable, as `src -> dst: why`; an empty list
    means every publish was. Only names still there afterwards count; `disk` is where `root`'s contents can be looked
    at now (default: `root` itself; a stand-in device's deploy root is elsewhere on the host)."""
    events = _events(log)
    root_path = PurePosixPath(root)
    here = disk or root

    def now(path: PurePosixPath) -> Path | None:
        """The host path of `path` when it is inside `root` and still exists (a symlink is not followed)."""
        if not path.is_relative_to(root_path):
            return None
        found = here / path.relative_to(root_path)
        return found if os.path.lexists(found) else None

    trace, bad = _Trace(), []
    publishes: list[tuple[int, PurePosixPath, PurePosixPath]] = []
    for i, event in enumerate(events):
        if event.kind == "fsync":
            trace.fsyncs.setdefault(event.path, []).append(i)
        elif event.kind == "sync":
            trace.syncs.append(i)
        elif event.kind in ("link", "symlink"):
            trace.placed[event.path] = i
            if event.kind == "symlink":
                trace.symlinks[event.path] = event.target
        else:
            if (found := now(event.path)) is not None:
                bad += [f"{event.src} -> {event.path}: {why}" for why in _unsynced(trace, event, found, i)]
                publishes.append((i, event.src, event.path))
            trace.move(event.src, event.path, i)
    end = len(events)
    for i, src, dst in publishes:
        if not trace.durable(dst.parent, i, end):
            bad.append(f"{src} -> {dst}: {dst.parent} not synced after the rename")
    return bad


def _unsynced(trace: _Trace, event: _Event, found: Path, at: int) -> list[str]:
    """Why the rename `event` (at index `at`) publishes something not yet on disk; [] when it does not."""
    src, dst = event.src, event.path
    if found.is_symlink():
        target = PurePosixPath(os.path.normpath(dst.parent / trace.symlinks.get(src, "")))
        placed = trace.placed.get(target)
        if placed is not None and not trace.durable(target.parent, placed, at):
            return [f"points at {target}, whose rename into place was not synced before the switch"]
        return []
    if found.is_dir():
        inside = {p: i for p, i in trace.under(src).items() if os.path.lexists(found / p.relative_to(src))}
        why = [f"{p.relative_to(src)} not synced" for p in sorted(inside) if not trace.synced_since_placed(p, at)]
        last = max(inside.values(), default=-1)
        if not trace.durable(src, last, at):
            why.append(f"{src} (its entries) not synced")
        return why
    if not trace.synced_since_placed(src, at):
        return ["data not synced"]
    return []


def published(log: Path, root: Path) -> list[PurePosixPath]:
    """The names the trace renamed into `root`, in order (so a test can tell that it saw a write at all)."""
    return [e.path for e in _events(log) if e.kind == "rename" and e.path.is_relative_to(PurePosixPath(root))]


def publishes(log: Path, root: Path) -> int:
    """How many renames into `root` the trace holds."""
    return len(published(log, root))
