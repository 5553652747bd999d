"""Small file helpers every module uses: sha256 of a file, durable atomic writes, JSON read with one-line errors,
and the first line of an error message.

A write that publishes data is durable: the data is written to a temp file beside the target and fsynced, renamed
over the target, and the directory fsynced, so after a power cut a reader finds the old file or the new one, whole
(a rename alone can reach the disk before the data it names).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large engines don't need to fit in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new names) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dest: Path) -> None:
    """Make the fully written `tmp` become `dest`, durably: fsync the data, one rename, fsync the directory."""
    fsync_file(tmp)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path beside `path` for a writer that wants a file name (safetensors, onnx.save, torch.save);
    published as `path` when the block ends without an error, removed otherwise."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        publish(tmp, path)
    except OSError as err:
        # A read-only or full disk is the user's to fix: one line naming the file, not a traceback.
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
            raise
        raise PipelineError(f"{path}: cannot write: {err.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def clear_leftovers(directory: Path) -> list[str]:
    """Remove what a killed writer left in `directory` (`.staging-*` directories, `.*.tmp` files) and return their
    names. Only for a stage's own output directory, under its stage lock, where no other writer can be at work."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.startswith(".staging-") or _is_temp(p.name)]
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return sorted(p.name for p in found)


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file durably and atomically: a crash never leaves half a file, or a name without its data."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Write a text file durably and atomically (see :func:`write_bytes`)."""
    write_bytes(path, text.encode())


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically, keys sorted, so manifests diff cleanly."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


TOO_DEEP = "lists or tables nested too deeply to read"
"""The one-line reason for input nested past Python's recursion limit: the JSON and TOML parsers recurse once per
level (or more) and end in RecursionError, a traceback, where any other malformed input is one line."""


def read_json(path: Path) -> Any:
    """Read a JSON file written by the pipeline, turning a missing or corrupt one into a one-line error."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found") from None
    except UnicodeDecodeError as err:
        raise PipelineError(f"{path}: corrupt JSON: {err}") from None
    return parse_json(text, str(path))


def parse_json(text: str, where: str) -> Any:
    """JSON `text` read from `where` (a file, a device's report); malformed or too deeply nested is one line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PipelineError(f"{where}: corrupt JSON: {err}") from None
    except RecursionError:
        raise PipelineError(f"{where}: corrupt JSON: {TOO_DEEP}") from None


def first_line(err: BaseException | str, typed: bool = False) -> str:
    """The first non-empty line of an error (colour codes removed), for one-line messages; `typed` puts the
    exception's type in front. Libraries (ONNX, ONNX Runtime, DCP) raise messages many lines long."""
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    name = type(err).__name__ if isinstance(err, BaseException) else ""
    if not lines:
        return name or "error"
    return f"{name}: {lines[0]}" if typed and name else lines[0]
