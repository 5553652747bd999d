"""Place a set of files on a device as one directory: verified, deduplicated, resumable.

The directory `<parent>/<id>` only ever appears whole: files land in `<parent>/<id>.part/` (each renamed from
`<name>.tmp` when whole, by `Device.put`), `sha256sum -c SHA256SUMS` runs on the device, and only then is `.part`
renamed. A file the device already holds anywhere under `<parent>/*/` (another version, an interrupted upload) is
found by its sha256 and hard-linked instead of sent, so an unchanged set sends nothing and a changed one only what
changed. Used for the code and the checkpoints training sends to its devices.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.files import sha256_file
from pipeline.fleet.names import safe_name
from pipeline.fleet.ssh import Completed

SUMS = "SHA256SUMS"
FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class Remote(Protocol):
    """What an upload needs of a device connection (`pipeline.fleet.ssh.Device` has it)."""

    async def run(self, command: str, timeout_s: int | None = None, stdin: str | None = None) -> Completed: ...

    async def put(self, local: Path, remote: str) -> int: ...


class UploadFailed(Exception):
    """The device could not take the files (no space, no permission, checksums that do not match)."""


@dataclass(frozen=True)
class Bundle:
    """Files that become `<parent>/<id>` on a device: flat names (a leading dot is allowed) → local files."""

    id: str
    files: dict[str, Path]
    sha256: dict[str, str]

    @property
    def sums(self) -> str:
        """SHA256SUMS text: `sha256  name` per file, sorted by name, as `sha256sum -c` reads it."""
        return "".join(f"{self.sha256[name]}  {name}\n" for name in sorted(self.files))

    @property
    def bytes(self) -> int:
        """Total size of the files."""
        return sum(path.stat().st_size for path in self.files.values())


def bundle(bundle_id: str, files: dict[str, Path]) -> Bundle:
    """A bundle of `files` (name → local path); names must be single path components (DCP's `__0_0.distcp` and
    `.metadata` are)."""
    for name in files:
        if not FILE_NAME.fullmatch(name) or name in (".", "..", SUMS):
            raise UploadFailed(f"file name {name!r}: not one plain path component")
    return Bundle(safe_name(bundle_id, "bundle id"), dict(files), {n: sha256_file(p) for n, p in files.items()})


@dataclass
class Sent:
    """What one upload cost: bytes and files sent, files linked from what the device had."""

    bytes: int = 0
    files: int = 0
    reused: int = 0


async def send(host: Remote, parent: str, item: Bundle, workdir: Path) -> Sent:
    """Make `<parent>/<item.id>` on the device hold exactly `item` (checked on the device); returns what it cost.

    `workdir` is a local directory for the SHA256SUMS file that travels last.
    """
    sent = Sent()
    where = f"{parent}/{item.id}"
    if await _complete(host, where, item):
        return sent
    sums = workdir / f"{item.id}.{SUMS}"
    sums.write_text(item.sums)
    have = await _have(host, parent, item.id)
    part = f"{item.id}.part"
    links = []
    for name in sorted(item.files):
        there = have.get(item.sha256[name])
        if there == f"{part}/{name}":
            continue
        if there is not None:
            links.append((there, f"{part}/{name}"))
            continue
        sent.bytes += await host.put(item.files[name], f"{parent}/{part}/{name}")
        sent.files += 1
    if links:
        script = " && ".join(f"{{ ln -f {_q(s)} {_q(d)} || cp {_q(s)} {_q(d)}; }}" for s, d in links)
        await _check(host, f"cd {_q(parent)} && {script}", "cannot reuse files already on the device")
        sent.reused = len(links)
    sent.bytes += await host.put(sums, f"{parent}/{part}/{SUMS}")
    await _verify(host, f"{parent}/{part}")
    command = f"cd {_q(parent)} && rm -rf {_q(item.id)} && mv {_q(part)} {_q(item.id)}"
    await _check(host, command, f"cannot rename {part}")
    return sent


def _q(text: str) -> str:
    return shlex.quote(text)


async def _check(host: Remote, command: str, what: str) -> Completed:
    out = await host.run(command)
    if not out.ok:
        raise UploadFailed(f"{what}: {out.tail()}")
    return out


async def _complete(host: Remote, where: str, item: Bundle) -> bool:
    """True when `where` holds this bundle's SHA256SUMS and every file it lists matches, checked on the device."""
    command = f"cd {_q(where)} 2>/dev/null && sha256sum -c {SUMS} >/dev/null 2>&1 && cat {SUMS}"
    out = await host.run(command)
    return out.ok and out.stdout == item.sums


async def _have(host: Remote, parent: str, bundle_id: str) -> dict[str, str]:
    """sha256 → path (relative to `parent`) of every whole file in `parent`'s directories and in this `.part`."""
    part = _q(f"{bundle_id}.part")
    command = (
        f"mkdir -p {_q(parent)}/{part} && cd {_q(parent)} && for f in {part}/* {part}/.[!.]* */* */.[!.]*; do "
        'case "$f" in *.tmp) continue ;; esac; [ -f "$f" ] && [ ! -L "$f" ] && [ ! -L "${f%/*}" ] && sha256sum "$f"; '
        "done; true"
    )
    out = await _check(host, command, f"cannot prepare {parent}/{bundle_id}.part")
    have: dict[str, str] = {}
    for line in out.stdout.splitlines():
        digest, _, path = line.partition("  ")
        have.setdefault(digest, path)
    return have


async def _verify(host: Remote, directory: str) -> None:
    """`sha256sum -c` on the device; files that fail are removed so that the next attempt sends them again."""
    out = await host.run(f"cd {_q(directory)} && sha256sum -c {SUMS}")
    if out.ok:
        return
    bad = [line.rsplit(":", 1)[0] for line in out.stdout.splitlines() if not line.endswith(": OK")]
    if bad:
        await host.run(f"cd {_q(directory)} && rm -f -- {' '.join(_q(n) for n in bad)}")
    raise UploadFailed(f"checksum mismatch on the device: {', '.join(bad) or out.tail()}")
