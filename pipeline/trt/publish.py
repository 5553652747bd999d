"""Where an engine goes once built and verified: the engine cache and a run's `engines/<class>/` (build.json last).

A build works in a staging directory of its own; a failed build keeps trtexec's log (its error says where), and the
next successful build removes that log. An engine cache entry is copied out only when it is as verified as asked for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.files import atomic_path, publish, read_json, write_json
from pipeline.layout import BUILD_INFO, PLAN
from pipeline.trt import cache
from pipeline.trt.engine_job import CACHE, LOG
from pipeline.trt.peer import shared


@contextlib.contextmanager
def staging(path: Path, failed_log: Path) -> Iterator[Path]:
    """A fresh directory at `path`, removed afterwards. A build failing with a trtexec log keeps the log as
    `failed_log` and raises the error again naming it; a success removes an earlier one."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    except PipelineError as err:
        log = path / LOG
        if not log.is_file():
            raise
        failed_log.parent.mkdir(parents=True, exist_ok=True)
        os.replace(log, failed_log)
        raise PipelineError(f"{err} (full log: {failed_log})") from None
    else:
        failed_log.unlink(missing_ok=True)
        # Empty when it held nothing but that log (this host's `local`, before its build named the class).
        with contextlib.suppress(OSError):
            failed_log.parent.rmdir()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def publish_engine(
    staging: Path, info: dict[str, Any], cache_dir: Path | None, dest: Path, status: str = "miss"
) -> dict[str, Any]:
    """Store the verified engine in `staging` (build.json `info`) in the engine cache (unless `cache_dir` is None: an
    engine no peer verified) and move it into `dest` (build.json last); returns build.json as published, its `cache`
    set to `status` (a fresh build: "miss")."""
    write_json(staging / BUILD_INFO, info)
    files = {PLAN: staging / PLAN, BUILD_INFO: staging / BUILD_INFO}
    if cache_dir is not None:
        cache.store(cache_dir, info["class"], info["cache_key"], files)
        cache.keep_timing_cache(staging / CACHE, cache_dir, info["class"])
    dest.mkdir(parents=True, exist_ok=True)
    for src, name in ((PLAN, PLAN), (CACHE, CACHE), (LOG, "build.log")):
        if (staging / src).is_file():
            publish(staging / src, dest / name)
    info = {**info, "cache": status}
    write_json(dest / BUILD_INFO, info)
    return info


def from_cache(cache_dir: Path, klass: str, key: str, dest: Path, verified: bool) -> dict[str, Any] | None:
    """Copy the engine cache's entry for (`klass`, `key`) into `dest` and return its build.json (`cache`: "hit");
    None on a miss, when `verified` asks for a verified engine and the entry was built without verification, or when
    a device built it and no second device verified it (an entry an older version stored)."""
    entry = cache.lookup(cache_dir, klass, key)
    if entry is None:
        return None
    info = {**read_info(entry), "cache": "hit"}
    if (verified and not info.get("verification", {}).get("loads")) or not shared(info):
        return None
    dest.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest / PLAN) as tmp:
        shutil.copyfile(entry / PLAN, tmp)
    write_json(dest / BUILD_INFO, info)
    return info


def read_info(entry: Path) -> dict[str, Any]:
    """build.json of an engine directory, which must be a JSON object."""
    info = read_json(entry / BUILD_INFO)
    if not isinstance(info, dict):
        raise PipelineError(f"{entry / BUILD_INFO}: not a JSON object (delete the entry)")
    return info
