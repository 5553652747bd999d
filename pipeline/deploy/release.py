"""Releases: the files one model version needs on a device, checked by a `sha256sum`-format SHA256SUMS.

A release is named by its content: `<run-id>-<first 8 hex of the sha256 of its SHA256SUMS>`, and SHA256SUMS lists
the sha256 of every other file (the engine included), so different bytes get different ids and the same bytes always
get the same one. (A target compares the whole SHA256SUMS digest before it takes an installed release for this one, so
even two contents whose ids collided would be told apart, and the live one refused rather than rewritten.) It is
staged as `releases/<id>.part/`, verified, and only then renamed to `releases/<id>/`: a release directory without
`.part` is always complete, and never rewritten. What a target is offered: `Releases` (a variant per device class,
each with its own id) for devices, `HostRelease` (this host's engine or none) for local targets.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.deploy.device_build import DeviceBuilds
from pipeline.deploy.hosts import Host
from pipeline.deploy.result import REFUSED, Stop, TargetResult
from pipeline.errors import PipelineError
from pipeline.files import read_json, sha256_file, write_json, write_text
from pipeline.fleet import upload
from pipeline.fleet.classes import LOCAL, checked
from pipeline.fleet.names import safe_name
from pipeline.fleet.probe import Facts
from pipeline.fleet.ssh import Device
from pipeline.fleet.upload import SUMS, Bundle, sums_text
from pipeline.layout import (
    DEPLOY_DIR,
    ENGINE_INFO,
    LABELS,
    MODEL_JSON,
    MODEL_JSON_NAME,
    ONNX,
    ONNX_NAME,
    PLAN,
    SAMPLE,
    SAMPLE_NAME,
)
from pipeline.manifest import RunDir
from pipeline.trt.peer import UNVERIFIED, private_to

ID_HEX = 8
"""Hex digits of the SHA256SUMS digest in a release id (ids stay short enough for an 80-column status table)."""


def release_id(run_id: str, sums_sha256: str) -> str:
    """`<run-id>-<first 8 hex of sha256(SHA256SUMS)>`: the id names every file of the release, not just the model."""
    return safe_name(f"{run_id}-{sums_sha256[:ID_HEX]}", "release id (from the run directory name)")


@dataclass(frozen=True)
class Release:
    """One release: the files (an upload bundle, named by its content), the directory holding its SHA256SUMS on this
    controller, and the device class of its engine, if it has one."""

    plan: Bundle
    engine_class: str | None
    workdir: Path
    only_for: str | None = None
    """The one device that may run its engine (built there, verified by no second device); None: any of its class."""

    @property
    def id(self) -> str:
        """The release id."""
        return self.plan.id


def make_release(
    run: RunDir,
    engine: tuple[Path, Path] | None,
    engine_class: str | None,
    extra: dict[str, Path] | None = None,
    out: Path | None = None,
) -> Release:
    """Gather the run's release files (plus `engine` = (model.plan, build.json) of `engine_class` when given, plus
    `extra` files such as the device-side activation script); write plan.json into `out` (default `<run>/deploy/`).

    labels.txt and SHA256SUMS are generated into `out` so every file of the release exists on disk and any transport
    (a local copy, SFTP) only moves files. Local and SSH deploys share this one plan.
    """
    onnx, meta, sample = run.path / ONNX, run.path / MODEL_JSON, run.path / SAMPLE
    _check_sample(sample)
    out = out or run.path / DEPLOY_DIR
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / LABELS, "".join(f"{c}\n" for c in model_classes(meta)))
    files = {ONNX_NAME: onnx, MODEL_JSON_NAME: meta, SAMPLE_NAME: sample, LABELS: out / LABELS}
    if engine is not None:
        files.update({PLAN: engine[0], ENGINE_INFO: engine[1]})
    files.update({safe_name(name, "release file"): path for name, path in (extra or {}).items()})
    sha256 = {name: sha256_file(path) for name, path in files.items()}
    digest = hashlib.sha256(sums_text(sha256).encode()).hexdigest()
    release = Release(upload.bundle(release_id(run.path.name, digest), files, sha256), engine_class, out)
    write_json(out / "plan.json", plan_json(release))
    return release


def engine_info(build_info: Path) -> dict[str, Any]:
    """An engine's build.json, which must be a JSON object."""
    info = read_json(build_info)
    if not isinstance(info, dict):
        raise PipelineError(f"{build_info}: not a JSON object (run `pipeline build` again)")
    return info


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


def plan_json(release: Release) -> dict[str, Any]:
    """What plan.json records: the release id, its size, and per file (SHA256SUMS too) its sha256, size and source."""
    plan = release.plan
    files = {
        name: {"sha256": plan.sha256[name], "bytes": path.stat().st_size, "source": str(path)}
        for name, path in plan.files.items()
    }
    sums = plan.sums_file(release.workdir)
    files[SUMS] = {"sha256": plan.sums_sha256, "bytes": sums.stat().st_size, "source": str(sums)}
    return {"release": plan.id, "bytes": plan.bytes + sums.stat().st_size, "files": files}


@dataclass(frozen=True)
class HostRelease:
    """The release for local targets: this host's engine, or ONNX only. There is no device class to check (the
    probe's facts describe this machine, not a Jetson), so every local target takes it."""

    release: Release
    build_time_s = 0
    """Nothing is built on a local target."""

    @property
    def id(self) -> str:
        """The release id."""
        return self.release.id

    async def for_device(self, host: Host, facts: Facts, row: TargetResult) -> Release:
        """The one release, whatever the probe found."""
        return self.release

    def device_class(self, facts: Facts, target: str) -> str:
        """The class of the engine it carries; "local" (this host) when it carries none."""
        return self.release.engine_class or LOCAL


class Releases:
    """The run's release as each device class gets it: with the engine built for that class, or ONNX only.

    Each variant has its own id (its files differ). The build stage's are planned up front, under
    `<run>/deploy/releases/<class, or "onnx">/`, so a bad run directory fails before any device is touched; a class
    the run has no engine for gets one at install time (`builds`), and its variant is planned then.
    """

    def __init__(
        self,
        run: RunDir,
        engines: dict[str, tuple[Path, Path]],
        extra: dict[str, Path],
        builds: DeviceBuilds | None = None,
    ) -> None:
        self.run, self.extra, self.builds = run, extra, builds
        keys: dict[str, tuple[Path, Path] | None] = dict(engines) if engines else {"onnx": None}
        self.variants = {key: self._variant(key, key, engine) for key, engine in keys.items()}
        self._building: dict[str, asyncio.Lock] = {}

    def _variant(self, key: str, klass: str, engine: tuple[Path, Path] | None) -> Release:
        out = self.run.path / DEPLOY_DIR / "releases" / key
        release = make_release(self.run, engine, engine and klass, self.extra, out=out)
        return replace(release, only_for=engine and private_to(engine_info(engine[1])))

    @property
    def bytes(self) -> int:
        """Size of the largest variant."""
        return max(r.plan.bytes for r in self.variants.values())

    @property
    def build_time_s(self) -> int:
        """Extra time a target may take for an install-time build of its class's engine."""
        return self.builds.time_s if self.builds else 0

    async def for_device(self, host: Host, facts: Facts, row: TargetResult) -> Release:
        """The variant for a probed device. A device with TensorRT whose class has no engine gets one at install
        time (the first device of a class builds it, the others wait for it, and build their own when no second
        device verified it); without TensorRT it gets ONNX only when the run has no engines at all, else
        Stop(REFUSED), as when the engine is another device's alone."""
        name = host.target.name
        klass = self.device_class(facts, name)
        if klass in self.variants:
            return _offered(self.variants[klass], klass, name)
        if self.builds is not None and facts.tensorrt and isinstance(host, Device):
            async with self._building.setdefault(klass, asyncio.Lock()):
                if klass not in self.variants:
                    variant = self._variant(klass, klass, await self.builds.engine(host, facts, row))
                    # An engine no peer verified is its builder's variant, under a name no other device looks up.
                    self.variants[klass if variant.only_for is None else f"{klass}@{name}"] = variant
                    return variant
            return _offered(self.variants[klass], klass, name)
        if "onnx" in self.variants:
            return self.variants["onnx"]
        device = f"device is {klass} ({facts.model or 'unknown model'}"
        why = (
            f"{device}, no TensorRT package): it can neither build nor load one"
            if not facts.tensorrt
            else (f"{device}, TensorRT {facts.tensorrt}): build one for this class")
        )
        raise Stop(REFUSED, f"engine built for {', '.join(sorted(self.variants))}, {why}")

    def device_class(self, facts: Facts, target: str) -> str:
        """The class of probed device `target`; Stop(REFUSED) when what it reported names none (classes.checked)."""
        try:
            return str(checked(facts, target))
        except PipelineError as err:
            raise Stop(REFUSED, str(err)) from None

    def summary(self) -> dict[str, Any]:
        """plan.json content: each variant's release id and files."""
        return {"variants": {key: plan_json(r) for key, r in self.variants.items()}}


def _offered(variant: Release, klass: str, device: str) -> Release:
    """`variant` for `device`; Stop(REFUSED) when its engine is another device's alone."""
    if variant.only_for not in (None, device):
        raise Stop(
            REFUSED,
            f"the {klass} engine was built on {variant.only_for} and is {UNVERIFIED}: only {variant.only_for} runs it "
            "(build it again while another device of the class is reachable)",
        )
    return variant


Offer = Releases | HostRelease
"""What a deploy offers a target: the variant for its probed class (devices), or this host's release (local)."""
