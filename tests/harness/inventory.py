"""Write a fleet inventory TOML in the shape `pipeline deploy` reads ([defaults], [policy], [[targets]])."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import toml_key, toml_value

DEFAULT_POLICY: dict[str, Any] = {
    "canary": 1,
    "wave_size": 4,
    "max_parallel": 8,
    "max_failure_pct": 25,
    "keep_releases": 3,
    "timeout_s": 300,
}


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
