"""Releases: the files one model version needs on a device, checked by a `sha256sum`-format SHA256SUMS.

A release is named `<run-id>-<first 8 hex of the ONNX's sha256>`, staged as `releases/<id>.part/`, verified, and
only then renamed to `releases/<id>/`: a release directory without `.part` is always complete.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PipelineError
from pipeline.files import read_json, sha256_file, write_json, write_text
from pipeline.fleet.names import SAFE_NAME, safe_name
from pipeline.layout import DEPLOY_DIR, MODEL_JSON, ONNX, PLAN, SAMPLE
from pipeline.manifest import RunDir

SUMS = "SHA256SUMS"
REQUIRED = ("model.onnx", "model.json", "labels.txt", "sample.npz")
_SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def release_id(run_id: str, onnx: Path) -> str:
    """`<run-id>-<first 8 hex of sha256(onnx)>`: a new model in the same run is a new release."""
    return safe_name(f"{run_id}-{sha256_file(onnx)[:8]}", "release id (from the run directory name)")


@dataclass(frozen=True)
class ReleasePlan:
    """What goes into one release: file name in the release → source file, and each file's sha256."""

    release_id: str
    files: dict[str, Path]
    sha256: dict[str, str]

    @property
    def bytes(self) -> int:
        """Total size of the release."""
        return sum(path.stat().st_size for path in self.files.values())


def sums_text(sha256: dict[str, str]) -> str:
    """SHA256SUMS content, as `sha256sum` writes it (so `sha256sum -c` on a device checks it)."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(sha256.items()))


def parse_sums(text: str, where: str) -> dict[str, str]:
    """name → sha256 from SHA256SUMS text; malformed lines and unsafe names are errors."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        match = _SUMS_LINE.match(line)
        if match is None:
            raise PipelineError(f"{where}: line {number} is not `<sha256>  <name>`")
        out[safe_name(match[2], f"{where}: line {number}")] = match[1]
    return out


def verify_dir(release: Path) -> str | None:
    """None when every file SHA256SUMS lists is present with that hash and the required files are listed."""
    sums = release / SUMS
    if not sums.is_file():
        return f"no {SUMS}"
    try:
        listed = parse_sums(sums.read_text(), str(sums))
    except (PipelineError, UnicodeDecodeError) as err:
        return str(err)
    missing = [name for name in REQUIRED if name not in listed]
    if missing:
        return f"{SUMS} does not list {', '.join(missing)}"
    for name, digest in listed.items():
        path = release / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name}: sha256 does not match {SUMS}"
    return None


def make_plan(
    run: RunDir, engine: tuple[Path, Path] | None, extra: dict[str, Path] | None = None, out: Path | None = None
) -> ReleasePlan:
    """Gather the run's release files (plus `engine` = (model.plan, build.json) when given, plus `extra` files such
    as the device-side activation script); write plan.json into `out` (default `<run>/deploy/`).

    labels.txt and SHA256SUMS are generated into `<run>/deploy/` so every file of the release exists on disk and
    any transport (a copy here, SFTP) only moves files. Local and SSH deploys share this one plan.
    """
    onnx, meta, sample = run.path / ONNX, run.path / MODEL_JSON, run.path / SAMPLE
    _check_sample(sample)
    out = out or run.path / DEPLOY_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "labels.txt", "".join(f"{c}\n" for c in model_classes(meta)))
    files = {"model.onnx": onnx, "model.json": meta, "sample.npz": sample, "labels.txt": out / "labels.txt"}
    if engine is not None:
        files.update({PLAN: engine[0], "engine.json": engine[1]})
    files.update({safe_name(name, "release file"): path for name, path in (extra or {}).items()})
    sha256 = {name: sha256_file(path) for name, path in files.items()}
    write_text(out / SUMS, sums_text(sha256))
    files[SUMS] = out / SUMS
    sha256[SUMS] = sha256_file(out / SUMS)
    plan = ReleasePlan(release_id(run.path.name, onnx), files, sha256)
    write_json(out / "plan.json", plan_json(plan))
    return plan


def model_classes(meta_path: Path) -> list[str]:
    """Class names from model.json: its top-level `classes`, or a `classes` one table down."""
    meta: Any = read_json(meta_path)
    tables = [meta, *(v for v in meta.values() if isinstance(v, dict))] if isinstance(meta, dict) else []
    for table in tables:
        classes = table.get("classes")
        if isinstance(classes, list) and classes and all(isinstance(c, str | int) for c in classes):
            return [str(c) for c in classes]
    raise PipelineError(f"{meta_path}: no `classes` list (needed for labels.txt and the health check)")


def _check_sample(sample: Path) -> None:
    try:
        with np.load(sample) as data:
            missing = [key for key in ("input", "logits") if key not in data.files]
    except (OSError, ValueError) as err:
        raise PipelineError(f"{sample}: not a readable .npz: {err}") from None
    if missing:
        raise PipelineError(f"{sample}: missing array(s) {', '.join(missing)}")


def plan_json(plan: ReleasePlan) -> dict[str, Any]:
    """What plan.json records: the release id, its size, and per file its sha256, size and source."""
    files = {
        name: {"sha256": plan.sha256[name], "bytes": path.stat().st_size, "source": str(path)}
        for name, path in plan.files.items()
    }
    return {"release": plan.release_id, "bytes": plan.bytes, "files": files}


def list_releases(root: Path) -> list[str]:
    """Complete release ids on a target, newest (most recently installed or reused) first."""
    releases = root / "releases"
    if not releases.is_dir():
        return []
    found = [p for p in releases.iterdir() if p.is_dir() and SAFE_NAME.match(p.name) and not p.name.endswith(".part")]
    found.sort(key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    return [p.name for p in found]


def install_release(root: Path, plan: ReleasePlan) -> int:
    """Put `plan` at `root/releases/<id>/`; returns bytes copied (0 when the identical release is already there)."""
    releases = root / "releases"
    final = releases / plan.release_id
    if final.is_dir() and _is_same_release(final, plan):
        os.utime(final)  # "newest" for pruning means most recently deployed
        return 0
    part = releases / f"{plan.release_id}.part"
    shutil.rmtree(part, ignore_errors=True)  # left by an interrupted deploy
    part.mkdir(parents=True)
    copied = 0
    for name, src in plan.files.items():
        shutil.copyfile(src, part / safe_name(name, "release file"))
        copied += (part / name).stat().st_size
    problem = verify_dir(part)
    if problem is not None:
        shutil.rmtree(part, ignore_errors=True)
        raise PipelineError(f"{part}: copied release fails verification: {problem}")
    _replace_dir(part, final)
    return copied


def _is_same_release(release: Path, plan: ReleasePlan) -> bool:
    sums = release / SUMS
    return sums.is_file() and sums.read_bytes() == plan.files[SUMS].read_bytes() and verify_dir(release) is None


def _replace_dir(src: Path, dest: Path) -> None:
    """Rename `src` to `dest`; a stale or corrupt `dest` (same id, other content) is moved aside first.

    A directory cannot be renamed over a non-empty one, so that rare repair leaves `dest` missing for the
    instant between the two renames.
    """
    if dest.exists():
        aside = dest.with_name(f".{dest.name}.replaced-{os.getpid()}")
        os.rename(dest, aside)
        os.rename(src, dest)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(src, dest)
