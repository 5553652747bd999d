"""The engine cache kept across runs: `<cache_dir>/<class>/<key>/` holds an engine and its build.json, and
`<cache_dir>/<class>/timing.cache` the class's timing cache.

The key hashes everything that changes the engine: the ONNX file's sha256, the TensorRT version, the class, the
precision, the shapes and the builder options. Entries are written to a temp directory and renamed into place, so a
half-written entry is never a hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.files import atomic_path, fsync_dir, fsync_file, sha256_file
from pipeline.layout import BUILD_INFO, PLAN
from pipeline.trt.flags import Options, plan
from pipeline.trt.profile import Profile

ENTRY_FILES = (PLAN, BUILD_INFO)


def key_parts(run_path: Path, klass: str, version: str, options: Options, profile: Profile) -> dict[str, Any]:
    """What the engine depends on: the sha256 of the ONNX file `version` builds, the version, the class, the shapes
    and the builder options."""
    onnx = run_path / plan(version, options, run_path).onnx
    return {
        "onnx_sha256": sha256_file(onnx),
        "tensorrt": version,
        "class": klass,
        "shapes": profile.to_dict(),
        **options.key(),
    }


def engine_key(parts: dict[str, Any]) -> str:
    """sha256 of the key parts (sorted JSON), shortened to 24 hex digits for directory names."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def entry_dir(cache_dir: Path, klass: str, key: str) -> Path:
    """Where the engine for (class, key) lives."""
    return cache_dir / klass / key


def lookup(cache_dir: Path, klass: str, key: str) -> Path | None:
    """The entry directory when it holds a complete entry, else None."""
    entry = entry_dir(cache_dir, klass, key)
    return entry if all((entry / name).is_file() for name in ENTRY_FILES) else None


def store(cache_dir: Path, klass: str, key: str, files: dict[str, Path]) -> Path:
    """Copy `files` ({name in entry: source}) into the entry for (class, key), replacing an older one whole."""
    entry = entry_dir(cache_dir, klass, key)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, src in files.items():
        shutil.copyfile(src, tmp / name)
        fsync_file(tmp / name)
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)
    fsync_dir(entry.parent)
    return entry


def timing_cache(cache_dir: Path, klass: str) -> Path:
    """The class's timing cache (may not exist yet)."""
    return cache_dir / klass / "timing.cache"


def keep_timing_cache(src: Path, cache_dir: Path, klass: str) -> None:
    """Save the timing cache a build extended, for the next build of the class (one rename)."""
    if not src.is_file():
        return
    dest = timing_cache(cache_dir, klass)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
