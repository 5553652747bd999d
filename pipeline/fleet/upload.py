"""Place a set of files on a device as one directory: verified, durable, deduplicated, resumable.

The directory `<parent>/<id>` only ever appears whole and on disk. Four steps, each one or more remote commands, so
a connection cut between any two leaves the device with the old directory or the new one, never half of one:

1. `installed`: `<parent>/<id>` already holds exactly these files (checked on the device): nothing to do.
2. `stage`: files land in `<parent>/<id>.part/` (each renamed from `<name>.tmp` when whole, by the remote's `put`),
   several at once, SHA256SUMS last. A file the device already holds anywhere under `<parent>/*/` (another version,
   an interrupted upload) or in the caller's extra places is found by its sha256 and hard-linked instead of sent, so
   an unchanged set sends nothing, a changed one only what changed, and an interrupted one resumes.
3. `verify`: whatever SHA256SUMS does not list is removed from `.part`, the files and `.part` are synced to disk, then
   `sha256sum -c SHA256SUMS` runs on the device; files that fail are removed so that the next attempt sends them.
4. `publish`: `.part` is renamed to `<id>` (a damaged `<id>` moved aside first, unless a live link points at it) and
   `<parent>` is synced, so the rename is on disk before anyone is pointed at `<id>`.

`send` does all four. Used for the code and the checkpoints training sends to its devices, and for deploy's releases
(docs/ssh-and-devices.md#syncing-named-files-and-private-temp-directories).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.files import sha256_file, write_text
from pipeline.fleet.names import safe_name
from pipeline.fleet.ssh import Completed

SUMS = "SHA256SUMS"
PART = ".part"
"""Suffix of the directory a bundle is staged in, `<parent>/<id>.part`, until it is whole and renamed to `<id>`."""
FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
PUTS_IN_FLIGHT = 16
"""Files sent at once. Each costs a few round trips (SFTP open, write, close, rename), and over WiFi a round trip
can be 60 ms: one at a time, a dataset of small images spends minutes waiting
(docs/measurements.md#uploads-in-flight)."""
COMMAND_BYTES = 64 * 1024
"""Most bytes of one remote command built from file names: half of Linux's 128 KiB cap on one argument (the
command is `sh -c`'s), which no shell line may exceed whatever ARG_MAX says."""


class Remote(Protocol):
    """What an upload needs of a device: `pipeline.fleet.ssh.Device`, or deploy's `LocalHost`."""

    async def run(self, command: str, timeout_s: int | None = None) -> Completed: ...

    async def put(self, local: Path, remote: str) -> int: ...


class UploadFailed(Exception):
    """The device could not take the files (no space, no permission)."""


class VerifyFailed(UploadFailed):
    """The files on the device do not match SHA256SUMS (those that did not were removed, to be sent again)."""


class PublishFailed(UploadFailed):
    """`.part` could not be renamed into place (or the directory it would replace is live)."""


def sums_text(sha256: Mapping[str, str]) -> str:
    """SHA256SUMS text: `sha256  name` per file, sorted by name, as `sha256sum` writes it and `sha256sum -c` reads."""
    return "".join(f"{sha256[name]}  {name}\n" for name in sorted(sha256))


@dataclass(frozen=True)
class Bundle:
    """Files that become `<parent>/<id>` on a device: flat names (a leading dot is allowed) → local files."""

    id: str
    files: dict[str, Path]
    sha256: dict[str, str]

    @property
    def sums(self) -> str:
        """The SHA256SUMS text that travels with the files."""
        return sums_text(self.sha256)

    @property
    def sums_sha256(self) -> str:
        """sha256 of the SHA256SUMS text: one digest for the whole content."""
        return hashlib.sha256(self.sums.encode()).hexdigest()

    @property
    def bytes(self) -> int:
        """Total size of the files (SHA256SUMS not counted)."""
        return sum(path.stat().st_size for path in self.files.values())

    def sums_file(self, workdir: Path) -> Path:
        """`<workdir>/<id>.SHA256SUMS`, written when it does not hold this text yet: the file that is sent."""
        path = workdir / f"{self.id}.{SUMS}"
        if not path.is_file() or path.read_text() != self.sums:
            write_text(path, self.sums)
        return path


def bundle(bundle_id: str, files: dict[str, Path], sha256: Mapping[str, str] | None = None) -> Bundle:
    """A bundle of `files` (name → local path), hashed here unless `sha256` gives each file's digest; names must be
    single path components (DCP's `__0_0.distcp` and `.metadata` are)."""
    for name in files:
        if not FILE_NAME.fullmatch(name) or name in (".", "..", SUMS):
            raise UploadFailed(f"file name {name!r}: not one plain path component")
    digests = {n: sha256[n] for n in files} if sha256 is not None else {n: sha256_file(p) for n, p in files.items()}
    return Bundle(safe_name(bundle_id, "bundle id"), dict(files), digests)


@dataclass
class Sent:
    """What one upload cost: bytes and files sent (SHA256SUMS included), files linked from what the device had."""

    bytes: int = 0
    files: int = 0
    reused: int = 0


async def send(host: Remote, parent: str, item: Bundle, workdir: Path) -> Sent:
    """Make `<parent>/<item.id>` on the device hold exactly `item` (checked there, on disk); returns what it cost.

    `workdir` is a local directory for the SHA256SUMS file that travels last.
    """
    sent = Sent()
    if not await installed(host, parent, item):
        await stage(host, parent, item, workdir, sent)
        await verify(host, parent, item)
        await publish(host, parent, item)
    return sent


async def installed(host: Remote, parent: str, item: Bundle) -> bool:
    """True when `<parent>/<item.id>` holds this bundle's SHA256SUMS and every file it lists matches, checked on the
    device."""
    command = f"cd {_q(f'{parent}/{item.id}')} 2>/dev/null && sha256sum -c {SUMS} >/dev/null 2>&1 && cat {SUMS}"
    out = await host.run(command)
    return out.ok and out.stdout == item.sums


async def stage(host: Remote, parent: str, item: Bundle, workdir: Path, sent: Sent, also: Sequence[str] = ()) -> None:
    """Put into `<parent>/<id>.part/` what it lacks, up to :data:`PUTS_IN_FLIGHT` files at once and SHA256SUMS last,
    linking what the device already has; `sent` counts what it cost as it goes (so a cut upload still says what it
    sent). `also`: more shell globs, relative to `parent`, of files worth linking from (written by the caller, never
    from input)."""
    have = await _have(host, parent, item.id, also)
    part = f"{item.id}{PART}"
    wanted = [(name, local, item.sha256[name]) for name, local in item.files.items()]
    wanted.append((SUMS, item.sums_file(workdir), item.sums_sha256))
    links, sends = [], []
    for name, local, digest in wanted:
        there = have.get(digest)
        if there == f"{part}/{name}":
            continue
        if there is not None:
            links.append((there, f"{part}/{name}"))
        else:
            sends.append((name, local))
    for script in _batches([f"{{ ln -f {_q(s)} {_q(d)} || cp {_q(s)} {_q(d)}; }}" for s, d in links]):
        await _check(host, f"cd {_q(parent)} && {script}", "cannot reuse files already on the device")
    sent.reused = len(links)
    in_flight = asyncio.Semaphore(PUTS_IN_FLIGHT)

    async def put(name: str, local: Path) -> None:
        async with in_flight:
            size = await host.put(local, f"{parent}/{part}/{name}")
        sent.bytes += size  # not `+= await`: that reads the count before the wait, and the other puts add meanwhile
        sent.files += 1

    files = [asyncio.ensure_future(put(name, local)) for name, local in sends if name != SUMS]
    try:
        await asyncio.gather(*files)
    finally:
        for task in files:  # one failed: the rest stop too (the next attempt resumes what landed)
            task.cancel()
    if sends and sends[-1][0] == SUMS:
        await put(*sends[-1])


async def verify(host: Remote, parent: str, item: Bundle) -> None:
    """In `.part` on the device: remove what SHA256SUMS does not list (an interrupted upload's `.tmp`, a stale file:
    never promoted), sync the files and the directory to disk, then `sha256sum -c`. VerifyFailed when a file (or
    SHA256SUMS itself) does not match; the files that failed are removed so the next attempt sends them again."""
    part = f"{parent}/{item.id}{PART}"
    # The names kept are read from the SHA256SUMS just sent (its digest is checked below), not written into the
    # command: a command is one argument of `sh -c`, which Linux caps at 128 KiB (MAX_ARG_STRLEN), a few thousand
    # names. Each name (after the 64 hex digits and two spaces) sits on its own line of `$keep`.
    command = (
        f'cd {_q(part)} && nl="\n" && keep="$nl$(cut -c67- {SUMS})$nl" && set -- . && for f in * .[!.]* ..?*; do '
        f'[ -e "$f" ] || continue; case "$f" in {SUMS}) ;; *) case "$keep" in *"$nl$f$nl"*) ;; '
        f'*) rm -rf -- "$f"; continue ;; esac ;; esac; set -- "$@" "$f"; done && '
        # fsync each file kept and the directory (its entries: the renames and links); plain `sync` where that fails.
        '{ sync -- "$@" 2>/dev/null || sync; } && '
        f"sha256sum {SUMS} && sha256sum -c {SUMS}"
    )
    out = await host.run(command)
    lines = out.stdout.splitlines()
    digest = lines[0].split()[0] if lines else ""
    bad = [line.rsplit(":", 1)[0] for line in lines[1:] if not line.endswith(": OK")]
    bad = [name for name in bad if name in item.files]
    if out.ok and digest == item.sums_sha256:
        return
    if bad:
        for names in _batches([_q(n) for n in bad], " "):
            await host.run(f"cd {_q(part)} && rm -f -- {names}")
        raise VerifyFailed(f"checksum mismatch on the device: {', '.join(bad)}")
    if digest and digest != item.sums_sha256:
        raise VerifyFailed(f"checksum mismatch on the device: {SUMS} is not this one")
    raise VerifyFailed(f"checksum mismatch on the device: {out.tail()}")


async def publish(host: Remote, parent: str, item: Bundle, live: tuple[str, str] | None = None) -> None:
    """`.part` → `<parent>/<id>`, then `<parent>` synced. A `<id>` already there (damaged: `installed` said no) is
    moved aside first, unless `live` = (symlink, what it reads when it points at `<id>`) says it is in use: a live
    directory is never rewritten (the check runs on the device, right before the rename)."""
    rid, aside, part = _q(item.id), _q(f".{item.id}.replaced"), _q(f"{item.id}{PART}")
    in_use = f'[ "$(readlink {_q(live[0])})" != {_q(live[1])} ] && ' if live else ""
    command = (
        f"cd {_q(parent)} && rm -rf {aside} && {{ [ ! -e {rid} ] || {{ {in_use}mv {rid} {aside}; }}; }} && "
        f"mv {part} {rid} && rm -rf {aside} && {{ sync -- . 2>/dev/null || sync; }}"
    )
    out = await host.run(command)
    if not out.ok:
        raise PublishFailed(f"cannot rename {parent}/{item.id}{PART}: {out.tail()}")


def _q(text: str) -> str:
    return shlex.quote(text)


def _batches(parts: list[str], sep: str = " && ", limit: int = COMMAND_BYTES) -> Iterator[str]:
    """`parts` joined by `sep` into as few strings as keep each under `limit` bytes: one remote command each."""
    batch: list[str] = []
    size = 0
    for part in parts:
        if batch and size + len(sep) + len(part) > limit:
            yield sep.join(batch)
            batch, size = [], 0
        size += len(part) + (len(sep) if batch else 0)
        batch.append(part)
    if batch:
        yield sep.join(batch)


async def _check(host: Remote, command: str, what: str) -> Completed:
    out = await host.run(command)
    if not out.ok:
        raise UploadFailed(f"{what}: {out.tail()}")
    return out


async def _have(host: Remote, parent: str, bundle_id: str, also: Sequence[str]) -> dict[str, str]:
    """sha256 → path (relative to `parent`) of every whole file in `parent`'s directories, in this `.part` and in
    `also`; symlinks and files reached through one are not taken (a link may lead anywhere)."""
    part = _q(f"{bundle_id}{PART}")
    places = " ".join([f"{part}/*", f"{part}/.[!.]*", "*/*", "*/.[!.]*", *also])
    command = (
        f"mkdir -p {_q(parent)}/{part} && cd {_q(parent)} && for f in {places}; do "
        'case "$f" in *.tmp) continue ;; esac; [ -f "$f" ] && [ ! -L "$f" ] && [ ! -L "${f%/*}" ] && sha256sum "$f"; '
        "done; true"
    )
    out = await _check(host, command, f"cannot prepare {parent}/{bundle_id}{PART}")
    have: dict[str, str] = {}
    for line in out.stdout.splitlines():
        digest, _, path = line.partition("  ")
        have.setdefault(digest, path)
    return have
