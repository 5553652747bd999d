"""Write a fleet inventory TOML in the shape `pipeline deploy` reads ([defaults], [policy], [[targets]])."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_POLICY: dict[str, Any] = {
    "canary": 1,
    "wave_size": 4,
    "max_parallel": 8,
    "max_failure_pct": 25,
    "keep_releases": 3,
    "timeout_s": 300,
}
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(value: Any) -> str:
    """One TOML value: strings, ints, floats, bools, lists and inline tables of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        # A JSON string is a valid TOML basic string: same quotes, and escapes TOML also knows.
        return json.dumps(str(value))
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def toml_key(key: str) -> str:
    """A key, quoted only when it is not a bare key."""
    return key if BARE_KEY.fullmatch(key) else json.dumps(key)


def _table(header: str, items: Mapping[str, Any]) -> str:
    return header + "\n" + "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in items.items())


def write_inventory(
    path: Path, defaults: Mapping[str, Any], policy: Mapping[str, Any], targets: Sequence[Mapping[str, Any]]
) -> Path:
    """Write [defaults], [policy] and one [[targets]] table per entry to `path` (atomically); return `path`."""
    parts = [_table("[defaults]", defaults), _table("[policy]", policy)]
    parts += [_table("[[targets]]", target) for target in targets]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(parts))
    os.replace(tmp, path)
    return path
