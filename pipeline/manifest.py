"""Run directories and their lineage manifest; the stage runner that records and caches each stage.

Every stage reads files from the run directory and writes files into it. The manifest records, per stage, the
config digest, the sha256 of every input and output, metrics and timings. A stage whose config digest and input
hashes are unchanged, and whose outputs are still on disk unmodified, is not run again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Literal, TypedDict

from pipeline.config import Config, upgrade_snapshot, validate
from pipeline.errors import PipelineError
from pipeline.files import read_json, sha256_file, write_json
from pipeline.layout import CONFIG_SNAPSHOT, MANIFEST
from pipeline.version import UNKNOWN, revision

UTC = dt.timezone.utc  # noqa: UP017 -- datetime.UTC is 3.11+; the device side runs on 3.10 (docs/how-to/cluster.md)

Status = Literal["done", "cached", "skipped"]


@dataclass
class StageResult:
    """What a stage hands back: its status, outputs (paths relative to the run dir) and metrics."""

    stage: str
    """The stage's name."""
    status: Status
    """`done` (it ran), `cached` (config, inputs and outputs unchanged since it last ran) or `skipped`."""
    outputs: dict[str, str] = field(default_factory=dict)
    """What it wrote, by name: paths relative to the run directory."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The stage's numbers and facts (train's `val_accuracy`, for one), which later stages and `pipeline runs` read."""
    reason: str = ""
    """Why the stage was skipped or cached; empty when it ran."""


class Lineage(TypedDict):
    """What the stage runner records beside a stage's result in `manifest.json`: its cache key and what it wrote."""

    config_digest: str
    """sha256 of the config sections the stage declares (`Config.digest`)."""
    inputs: dict[str, str]
    """sha256 of every input file (paths relative to the run directory) and the stage's outside fingerprints."""
    output_hashes: dict[str, str]
    """sha256 of every file it wrote, checked before a cached result is trusted."""
    seconds: float
    """Wall time of the stage."""
    finished: str
    """When it ended, ISO 8601 in UTC."""


@dataclass(frozen=True)
class Stage:
    """What a stage declares about itself; the stage table (pipeline.stages) and the cache read only this."""

    name: str
    """The stage's name: its CLI subcommand, its manifest entry, its Prefect task."""
    sections: tuple[str, ...]
    """Config tables whose values change the stage's result (hashed into its cache key)."""
    inputs: tuple[str, ...]
    """Run-dir paths it reads, written by earlier stages (hashed into its cache key)."""
    outputs: dict[str, str]
    """Run-dir paths it always writes, by name (a stage may add more, e.g. one engine per device class)."""
    run: Callable[..., StageResult]
    """`run(cfg, run_dir, log=print, **options)`: the stage as a library function."""
    fingerprint: Callable[[Config], dict[str, str]] | None = None
    """What it reads from outside the run directory (the dataset, a weights file), as name → hash."""

    def external(self, cfg: Config) -> dict[str, str]:
        """The fingerprint of what the stage reads from outside the run directory ({} when nothing)."""
        return self.fingerprint(cfg) if self.fingerprint else {}


def new_run_id() -> str:
    """Sortable, unique run id: UTC timestamp plus a short random suffix."""
    return dt.datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def tool_versions() -> dict[str, str]:
    """Versions that decide whether an artifact can be reproduced: Python, key packages, source commit."""
    versions = {"python": platform.python_version()}
    for pkg in ("edge-pipeline", "torch", "onnx", "onnxruntime", "safetensors"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    commit = revision()
    if commit != UNKNOWN:
        versions["source_commit"] = commit
    return versions


MANIFEST_LOCK = ".manifest.lock"


@contextlib.contextmanager
def _flock(path: Path, blocking: bool) -> Iterator[IO[str] | None]:
    """An exclusive `flock` on `path` (created if need be) for the block; without `blocking`, None when another
    process holds it. The kernel drops the lock when its holder dies, so a killed command never leaves it held."""
    try:
        fh = path.open("a+")
    except OSError as err:
        raise PipelineError(f"{path.parent}: cannot write to the run directory: {err.strerror}") from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield fh


@contextlib.contextmanager
def stage_lock(run: RunDir, stage: str) -> Iterator[None]:
    """One writer per stage of a run directory: a second command that would change the same stage refuses with a
    line naming the holder (its pid, command and start time) instead of racing it."""
    path = run.path / f".{stage}.lock"
    with _flock(path, blocking=False) as held:
        if held is None:
            holder = path.read_text().strip() or "another process"
            raise PipelineError(f"{run.path}: stage {stage} is being run by {holder}; wait for it to finish")
        held.seek(0)
        held.truncate()
        started = dt.datetime.now(UTC).isoformat(timespec="seconds")
        held.write(f"pid {os.getpid()} ({' '.join(sys.argv[:3])}, since {started})\n")
        held.flush()
        yield


class RunDir:
    """A run directory and its manifest."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def manifest_path(self) -> Path:
        """Location of manifest.json."""
        return self.path / MANIFEST

    def manifest(self) -> dict[str, Any]:
        """The manifest as a dict (an empty skeleton for a new run directory)."""
        if not self.manifest_path.exists():
            return {"run_id": self.path.name, "stages": {}}
        return read_json(self.manifest_path)

    @contextlib.contextmanager
    def _update(self) -> Iterator[dict[str, Any]]:
        """The manifest to change in place, under an exclusive lock held until it is written back: two commands
        on one run directory (a CLI stage while the flow runs) never drop each other's records."""
        with _flock(self.path / MANIFEST_LOCK, blocking=True):
            manifest = self.manifest()
            yield manifest
            write_json(self.manifest_path, manifest)

    def save_config(self, cfg: Config) -> None:
        """Snapshot the resolved config so later per-stage commands reuse exactly what the run used."""
        write_json(self.path / CONFIG_SNAPSHOT, cfg.model_dump(mode="json"))
        with self._update() as manifest:
            manifest.setdefault("created", dt.datetime.now(UTC).isoformat(timespec="seconds"))
            manifest["config"] = cfg.model_dump(mode="json")
            manifest["versions"] = tool_versions()

    def config_data(self) -> dict[str, Any]:
        """The config snapshot written when the run started, as data, keys renamed since under their new names."""
        return upgrade_snapshot(read_json(self.path / CONFIG_SNAPSHOT))

    def load_config(self) -> Config:
        """The config snapshot written when the run started."""
        return validate(self.config_data(), str(self.path / CONFIG_SNAPSHOT))

    def record(self, result: StageResult, entry: Lineage) -> None:
        """Store a stage's result and lineage in the manifest."""
        with self._update() as manifest:
            manifest["stages"][result.stage] = {**asdict(result), **entry}

    def annotate(self, *keys: str, value: Any) -> None:
        """Set `manifest[k1][k2]... = value` (gate verdicts, why a run stopped), creating tables on the way."""
        with self._update() as manifest:
            node = manifest
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value

    def hashes(self, rel_paths: list[str]) -> dict[str, str]:
        """sha256 of each path relative to the run dir; directories hash their sorted files."""
        out: dict[str, str] = {}
        for rel in rel_paths:
            path = self.path / rel
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for f in files:
                if f.exists():
                    out[str(f.relative_to(self.path))] = sha256_file(f)
        return out


def create_run_dir(cfg: Config, run_dir: Path | None) -> RunDir:
    """Make (or reuse) the run directory and snapshot the config into it."""
    path = run_dir or cfg.run.runs_root / new_run_id()
    path.mkdir(parents=True, exist_ok=True)
    run = RunDir(path)
    run.save_config(cfg)
    return run


def _is_fresh(previous: dict[str, Any] | None, digest: str, inputs: dict[str, str], run: RunDir) -> bool:
    if not previous or previous.get("status") not in ("done", "cached"):
        return False
    if previous.get("config_digest") != digest or previous.get("inputs") != inputs:
        return False
    outputs: dict[str, str] = previous.get("output_hashes", {})
    return bool(outputs) and run.hashes(list(outputs)) == outputs


def _input_hashes(run: RunDir, stage: Stage, cfg: Config, external: dict[str, str] | None) -> dict[str, str]:
    missing = [rel for rel in stage.inputs if not (run.path / rel).exists()]
    if missing:
        raise PipelineError(f"{stage.name}: missing input {run.path / missing[0]} (run the earlier stages first)")
    return {**run.hashes(list(stage.inputs)), **stage.external(cfg), **(external or {})}


def cached_result(run: RunDir, cfg: Config, stage: Stage, log: Callable[[str], None] = print) -> StageResult | None:
    """The stage's recorded result when its config, inputs and outputs are unchanged since it last ran, else None."""
    return _cached(run, stage.name, cfg.digest(*stage.sections), _input_hashes(run, stage, cfg, None), log)


def _cached(
    run: RunDir, stage: str, digest: str, input_hashes: dict[str, str], log: Callable[[str], None]
) -> StageResult | None:
    previous = run.manifest()["stages"].get(stage)
    if not _is_fresh(previous, digest, input_hashes, run):
        return None
    assert previous is not None
    log(f"[{stage}] cached: inputs and config unchanged since {previous['finished']}")
    return StageResult(stage, "cached", previous["outputs"], previous["metrics"], "inputs and config unchanged")


def run_stage(
    run: RunDir,
    cfg: Config,
    stage: Stage,
    body: Callable[[], StageResult],
    log: Callable[[str], None] = print,
    external: dict[str, str] | None = None,
    cacheable: bool = True,
) -> StageResult:
    """Run one stage with caching and lineage.

    The cache key is the digest of the stage's config sections, the hashes of its inputs, its fingerprint of what
    lives outside the run dir, and `external` (facts only known at run time, such as the builder's TensorRT). When
    all are unchanged since the last successful run and its outputs are intact, `body` is not called. Stages whose
    truth lives elsewhere (deploy: the devices) pass `cacheable=False`.
    """
    with stage_lock(run, stage.name):
        return _run_locked(run, cfg, stage, body, log, external, cacheable)


def _run_locked(
    run: RunDir,
    cfg: Config,
    stage: Stage,
    body: Callable[[], StageResult],
    log: Callable[[str], None],
    external: dict[str, str] | None,
    cacheable: bool,
) -> StageResult:
    digest = cfg.digest(*stage.sections)
    input_hashes = _input_hashes(run, stage, cfg, external)
    if cacheable and (cached := _cached(run, stage.name, digest, input_hashes, log)):
        return cached
    started = time.perf_counter()
    result = body()
    seconds = round(time.perf_counter() - started, 3)
    entry: Lineage = {
        "config_digest": digest,
        "inputs": input_hashes,
        "output_hashes": run.hashes(list(result.outputs.values())),
        "seconds": seconds,
        "finished": dt.datetime.now(UTC).isoformat(timespec="seconds"),
    }
    run.record(result, entry)
    suffix = f": {result.reason}" if result.reason else ""
    log(f"[{stage.name}] {result.status} in {seconds:.1f}s{suffix}")
    return result
