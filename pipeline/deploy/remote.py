"""Deploying one release to one device over SSH: probe, refuse, upload what is missing, verify, rename, activate.

The device never holds a half release under its final name: files land in `releases/<id>.part/` (each file as
`<name>.tmp`, renamed when whole), `sha256sum -c SHA256SUMS` runs on the device, and only then is the directory
renamed to `releases/<id>`. Files the device already has (in the `.part` directory of an interrupted upload or in
another release) are found by sha256 and linked instead of sent. The switch itself is `activate.sh`, shipped in
the release, so it finishes on the device even if the connection drops.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from pipeline.deploy.release import SUMS, ReleasePlan, make_plan, plan_json, release_id
from pipeline.fleet.inventory import Policy, SshTarget
from pipeline.fleet.probe import Facts, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Device, HostKeyRefused
from pipeline.layout import DEPLOY_DIR, ONNX
from pipeline.manifest import RunDir

ACTIVATE = "activate.sh"
ACTIVE, ROLLED_BACK, PREFLIGHT_FAILED = "ACTIVE", "ROLLED_BACK", "PREFLIGHT_FAILED"
UNREACHABLE, REFUSED, SKIPPED = "UNREACHABLE", "REFUSED", "SKIPPED"
UPLOAD_FAILED, VERIFY_FAILED, FAILED = "UPLOAD_FAILED", "VERIFY_FAILED", "FAILED"
_PHASE_STATUS = {"connect": UNREACHABLE, "probe": UNREACHABLE, "upload": UPLOAD_FAILED, "verify": VERIFY_FAILED}


class Stop(Exception):
    """Ends one target's deploy with a status and a reason (not an error of the controller)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Release:
    """A plan plus what the controller needs to judge devices: the engine's device class, if it has an engine."""

    plan: ReleasePlan
    engine_class: str | None

    @property
    def id(self) -> str:
        """The release id."""
        return self.plan.release_id


class Releases:
    """The run's release as each device class gets it: with the engine built for that class, or ONNX only.

    All variants share one release id (the model is the same). Each is planned up front, under
    `<run>/deploy/releases/<class, or "onnx">/`, so a bad run directory fails before any device is touched.
    """

    def __init__(self, run: RunDir, engines: dict[str, tuple[Path, Path]], extra: dict[str, Path]) -> None:
        self.id = release_id(run.path.name, run.path / ONNX)
        keys: dict[str, tuple[Path, Path] | None] = dict(engines) if engines else {"onnx": None}
        self.variants = {
            key: Release(make_plan(run, engine, extra, out=run.path / DEPLOY_DIR / "releases" / key), engine and key)
            for key, engine in keys.items()
        }

    @property
    def bytes(self) -> int:
        """Size of the largest variant."""
        return max(r.plan.bytes for r in self.variants.values())

    def for_device(self, facts: Facts) -> Release:
        """The variant for a probed device; Stop(REFUSED) when the run has engines but none for its class."""
        if "onnx" in self.variants:
            return self.variants["onnx"]
        klass = facts.device_class
        if klass not in self.variants:
            raise Stop(
                REFUSED,
                f"engine built for {', '.join(sorted(self.variants))}, device is {klass} "
                f"({facts.model or 'unknown model'}, TensorRT {facts.tensorrt or 'unknown'}): build one for this class",
            )
        return self.variants[klass]

    def summary(self) -> dict[str, Any]:
        """plan.json content: the release id and each variant's files."""
        return {"release": self.id, "variants": {key: plan_json(r.plan) for key, r in self.variants.items()}}


def new_result(target: SshTarget, release_id: str) -> dict[str, Any]:
    """A target's result row before anything happened."""
    return {
        "target": target.name,
        "host": f"{target.host}:{target.port}",
        "status": SKIPPED,
        "release": release_id,
        "current": "",
        "previous": "",
        "device_class": "",
        "bytes_sent": 0,
        "files_sent": 0,
        "files_reused": 0,
        "seconds": 0.0,
        "reason": "",
    }


async def deploy(
    target: SshTarget, releases: Releases, policy: Policy, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Deploy the run's release to `target`; never raises for device-side problems: they become the row's status."""
    result = new_result(target, releases.id)
    started = time.perf_counter()
    phase = ["connect"]
    try:
        await asyncio.wait_for(_session(target, releases, policy, result, phase), timeout=policy.timeout_s)
    except Stop as stop:
        result["status"], result["reason"] = stop.status, stop.reason
    except HostKeyRefused as err:
        result["status"], result["reason"] = REFUSED, str(err)
    except FAILURES as err:
        result["status"] = _PHASE_STATUS.get(phase[0], FAILED)
        result["reason"] = f"{phase[0]}: {_describe(err, policy)}" + (
            " (device state unknown: run `pipeline deploy status`)" if phase[0] == "activate" else ""
        )
    result["seconds"] = round(time.perf_counter() - started, 3)
    why = f": {result['reason']}" if result["reason"] else ""
    log(f"[deploy] {target.name}: {result['status']} {releases.id} ({result['bytes_sent']} bytes sent){why}")
    return result


async def _session(
    target: SshTarget, releases: Releases, policy: Policy, result: dict[str, Any], phase: list[str]
) -> None:
    async with Device(target, policy.timeout_s) as device:
        await _deploy(device, releases, policy, result, phase)


def _describe(err: BaseException, policy: Policy) -> str:
    if isinstance(err, TimeoutError):
        return f"no answer within timeout_s = {policy.timeout_s} s"
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    # SFTP has no distinct "disk full" code; the space check before uploading makes this rare.
    return what + (" (disk full?)" if isinstance(err, asyncssh.SFTPFailure) else "")


async def probe(device: Device) -> Facts:
    """Probe the device (read-only)."""
    out = await device.run(probe_script(device.target.root), timeout_s=30)
    if not out.ok:
        raise Stop(UNREACHABLE, f"probe failed: {out.tail()}")
    return parse_facts(out.stdout)


async def _deploy(device: Device, releases: Releases, policy: Policy, result: dict[str, Any], phase: list[str]) -> None:
    phase[0] = "probe"
    facts = await probe(device)
    result |= {"device_class": facts.device_class, "previous": facts.current, "current": facts.current}
    release = releases.for_device(facts)
    phase[0] = "upload"
    if not await _installed(device, release):
        _refuse_space(release, facts)
        await _upload(device, release, result)
        phase[0] = "verify"
        await _verify(device, release)
        await _rename(device, release)
    elif facts.current == release.id:
        result |= {"status": ACTIVE, "reason": "already active"}
        return
    phase[0] = "activate"
    await _activate(device, release, policy, result)


def _refuse_space(release: Release, facts: Facts) -> None:
    need = 2 * release.plan.bytes
    if facts.free_bytes is None or facts.free_bytes < need:
        free = "unknown" if facts.free_bytes is None else f"{facts.free_bytes / 1e6:.1f} MB"
        raise Stop(REFUSED, f"free space {free} in the deploy root < 2x the release ({need / 1e6:.1f} MB)")


def _root(device: Device) -> str:
    return shlex.quote(device.target.root)


async def _installed(device: Device, release: Release) -> bool:
    """True when `releases/<id>` holds exactly this release and every file matches its SHA256SUMS on the device."""
    rid = shlex.quote(release.id)
    command = (
        f"mkdir -p {_root(device)}/releases && cd {_root(device)}/releases && [ -f {rid}/{SUMS} ] && "
        f"sha256sum {rid}/{SUMS} && cd {rid} && sha256sum -c {SUMS} >/dev/null 2>&1"
    )
    out = await device.run(command)
    return out.ok and out.stdout.split()[:1] == [release.plan.sha256[SUMS]]


async def _have(device: Device, release: Release) -> dict[str, str]:
    """sha256 → device path (relative to releases/) of every whole file in the releases and in this `.part`."""
    part = shlex.quote(f"{release.id}.part")
    command = (
        f"cd {_root(device)}/releases && mkdir -p {part} && for f in {part}/* */*; do "
        'case "$f" in *.tmp) continue ;; esac; [ -f "$f" ] && [ ! -L "$f" ] && sha256sum "$f"; done; true'
    )
    out = await device.run(command)
    if not out.ok:
        raise Stop(UPLOAD_FAILED, f"cannot prepare releases/{release.id}.part: {out.tail()}")
    have: dict[str, str] = {}
    for line in out.stdout.splitlines():
        digest, _, path = line.partition("  ")
        have.setdefault(digest, path)
    return have


async def _upload(device: Device, release: Release, result: dict[str, Any]) -> None:
    """Send what the device lacks into `.part`; SHA256SUMS goes last."""
    have = await _have(device, release)
    part = f"{release.id}.part"
    links, sends = [], []
    for name in sorted(release.plan.files, key=lambda n: n == SUMS):
        there = have.get(release.plan.sha256[name])
        if there == f"{part}/{name}":
            continue
        if there is not None:
            links.append((there, f"{part}/{name}"))
        else:
            sends.append(name)
    if links:
        script = " && ".join(
            f"{{ ln -f {shlex.quote(s)} {shlex.quote(d)} || cp {shlex.quote(s)} {shlex.quote(d)}; }}" for s, d in links
        )
        out = await device.run(f"cd {_root(device)}/releases && {script}")
        if not out.ok:
            raise Stop(UPLOAD_FAILED, f"cannot reuse files already on the device: {out.tail()}")
        result["files_reused"] = len(links)
    base = f"{device.target.root}/releases/{part}"
    for name in sends:
        result["bytes_sent"] += await device.put(release.plan.files[name], f"{base}/{name}")
        result["files_sent"] += 1


async def _verify(device: Device, release: Release) -> None:
    """`sha256sum -c` in `.part` on the device; files that fail are removed so the next attempt sends them again."""
    part = shlex.quote(f"{device.target.root}/releases/{release.id}.part")
    out = await device.run(f"cd {part} && sha256sum -c {SUMS}")
    if out.ok:
        return
    bad = [line.rsplit(":", 1)[0] for line in out.stdout.splitlines() if not line.endswith(": OK")]
    names = [n for n in bad if n in release.plan.files]
    if names:
        await device.run(f"cd {part} && rm -f -- {' '.join(shlex.quote(n) for n in names)}")
    raise Stop(VERIFY_FAILED, f"checksum mismatch on the device: {', '.join(names) or out.tail()}")


async def _rename(device: Device, release: Release) -> None:
    """`.part` → `releases/<id>`; a stale directory of the same id (other content) is moved aside first."""
    rid = shlex.quote(release.id)
    aside = shlex.quote(f".{release.id}.replaced")
    command = (
        f"cd {_root(device)}/releases && rm -rf {aside} && {{ [ ! -e {rid} ] || mv {rid} {aside}; }} && "
        f"mv {shlex.quote(release.id + '.part')} {rid} && rm -rf {aside}"
    )
    out = await device.run(command)
    if not out.ok:
        raise Stop(FAILED, f"cannot rename releases/{release.id}.part: {out.tail()}")


def activate_command(target: SshTarget, release_id: str, keep: int) -> str:
    """The remote command that runs a release's activation script."""
    args = [target.root, release_id, str(keep), target.service, target.health_command]
    script = f"{target.root}/releases/{release_id}/{ACTIVATE}"
    return f"sh {shlex.quote(script)} " + " ".join(shlex.quote(a) for a in args)


def parse_activation(stdout: str) -> dict[str, str]:
    """The `ACTIVATE key=value` lines of activate.sh."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        if line.startswith("ACTIVATE "):
            key, _, value = line[len("ACTIVATE ") :].partition("=")
            found[key] = value
    return found


async def _activate(device: Device, release: Release, policy: Policy, result: dict[str, Any]) -> None:
    out = await device.run(activate_command(device.target, release.id, policy.keep_releases))
    apply_activation(out.stdout, out.tail(), result)


def apply_activation(stdout: str, tail: str, result: dict[str, Any]) -> None:
    """Fold the activation script's report into a result row."""
    report = parse_activation(stdout)
    result["status"] = report.get("status", FAILED)
    result["current"] = report.get("current", result["current"])
    result["reason"] = report.get("reason", "") if "status" in report else f"activate.sh: {tail}"
    if result["status"] == ACTIVE and result["current"] != result["release"]:
        result |= {"status": FAILED, "reason": f"activate.sh said ACTIVE but current is {result['current']!r}"}
