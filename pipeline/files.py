"""Small file helpers every module uses: sha256 of a file, JSON written atomically and read with one-line errors,
and the first line of an error message."""

from __future__ import annotations

import hashlib
import json
import os
import re
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


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (temp file + rename): a crash never leaves half a file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically, keys sorted, so manifests diff cleanly."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    """Read a JSON file written by the pipeline, turning a missing or corrupt one into a one-line error."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PipelineError(f"{path}: corrupt JSON: {err}") from None


def first_line(err: BaseException | str, typed: bool = False) -> str:
    """The first non-empty line of an error (colour codes removed), for one-line messages; `typed` puts the
    exception's type in front. Libraries (ONNX, ONNX Runtime, DCP) raise messages many lines long."""
    lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()]
    name = type(err).__name__ if isinstance(err, BaseException) else ""
    if not lines:
        return name or "error"
    return f"{name}: {lines[0]}" if typed and name else lines[0]
