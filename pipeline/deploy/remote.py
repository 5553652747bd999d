"""Deploying one release to one target: probe, refuse, build its class's engine if needed, upload what is missing,
verify, rename, activate.

The steps are the same for a Jetson over SSH and for a local target (a device reached without SSH, through
`hosts.LocalHost`). A device whose class has no engine in the run builds one first (`device_build`). The upload is
`pipeline.fleet.upload`, as for the code training ships: the target never holds a half release under its final name
(files land in `releases/<id>.part/`, are synced and checked by `sha256sum -c SHA256SUMS` on the target, and only then
is the directory renamed to `releases/<id>` and `releases/` synced), and files the target already has (in the `.part`
directory of an interrupted upload, in another release, or an engine it built at install time) are linked, not sent.
The switch itself is `activate.sh`, shipped in the release, so it finishes on the device even if the connection
drops.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncssh

from pipeline.deploy.hosts import Host, Spot
from pipeline.deploy.release import Offer, Release
from pipeline.deploy.result import (
    ACTIVE,
    FAILED,
    REFUSED,
    ROLLED_BACK,
    UNREACHABLE,
    UPLOAD_FAILED,
    VERIFY_FAILED,
    Stop,
    TargetResult,
)
from pipeline.errors import PipelineError
from pipeline.files import first_line
from pipeline.fleet import upload
from pipeline.fleet.inventory import Policy, SshTarget
from pipeline.fleet.names import SAFE_NAME
from pipeline.fleet.probe import Facts, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Completed, Refused
from pipeline.fleet.upload import PART, SUMS
from pipeline.layout import ACTIVATE, CURRENT, DEVICE_CACHE, ONNX_NAME, PLAN, PREVIOUS, RELEASES, SAMPLE_NAME

ACTIVATE_NAMES = {
    "RELEASES_DIR": RELEASES,
    "CURRENT_LINK": CURRENT,
    "PREVIOUS_LINK": PREVIOUS,
    "PART_SUFFIX": PART,
    "SUMS_FILE": SUMS,
    "PLAN_FILE": PLAN,
    "ONNX_FILE": ONNX_NAME,
    "SAMPLE_FILE": SAMPLE_NAME,
}
"""The deploy root's names activate.sh works with, by the environment variable it reads each from: the script spells
none of them, so layout (and upload, for its staging names) declare them once for the controller and the device."""

# A transport failure during a step; an install-time build that fails on its own is BUILD_FAILED (device_build).
_PHASE_STATUS = {
    "connect": UNREACHABLE,
    "probe": UNREACHABLE,
    "build": UNREACHABLE,
    "upload": UPLOAD_FAILED,
    "verify": VERIFY_FAILED,
}


@dataclass
class _Step:
    """The step a deploy is at: a transport failure during it gets that step's status (`_PHASE_STATUS`)."""

    name: str = "connect"


def new_result(target: Spot, release_id: str = "") -> TargetResult:
    """A target's result row before anything happened (the release is known once the device is probed)."""
    host = f"{target.host}:{target.port}" if isinstance(target, SshTarget) else "local"
    return TargetResult(target=target.name, host=host, root=target.root, release=release_id)


async def deploy(host: Host, offer: Offer, policy: Policy, log: Callable[[str], None] = print) -> TargetResult:
    """Deploy the run's release to the target `host` reaches (entered here); never raises for target-side problems:
    they become the row's status."""
    row = new_result(host.target)
    started = time.perf_counter()
    step = _Step()
    try:
        timeout = policy.timeout_s + offer.build_time_s
        await asyncio.wait_for(_session(host, offer, policy, row, step), timeout=timeout)
    except Stop as stop:
        row.status, row.reason = stop.status, stop.reason
    except Refused as err:
        row.status, row.reason = REFUSED, str(err)
    except PipelineError as err:  # the controller's own step for this target: the other targets go on
        row.status, row.reason = FAILED, first_line(err)
    except FAILURES as err:
        row.status = _PHASE_STATUS.get(step.name, FAILED)
        row.reason = f"{step.name}: {_describe(err, policy)}" + (
            " (device state unknown: run `pipeline deploy status`)" if step.name == "activate" else ""
        )
    row.seconds = round(time.perf_counter() - started, 3)
    why = f": {row.reason}" if row.reason else ""
    log(f"[deploy] {row.target}: {row.status} {row.release} ({row.bytes_sent} bytes sent){why}")
    return row


async def _session(host: Host, offer: Offer, policy: Policy, row: TargetResult, step: _Step) -> None:
    async with host:
        await _deploy(host, offer, policy, row, step)


def _describe(err: BaseException, policy: Policy) -> str:
    if isinstance(err, TimeoutError):
        return f"no answer within timeout_s = {policy.timeout_s} s"
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    # SFTP has no distinct "disk full" code; the space check before uploading makes this rare.
    return what + (" (disk full?)" if isinstance(err, asyncssh.SFTPFailure) else "")


async def probe(host: Host) -> Facts:
    """Probe the target (read-only)."""
    out = await host.run(probe_script(host.target.root), timeout_s=30)
    if not out.ok:
        raise Stop(UNREACHABLE, f"probe failed: {out.tail()}")
    return parse_facts(out.stdout)


async def _deploy(host: Host, offer: Offer, policy: Policy, row: TargetResult, step: _Step) -> None:
    step.name = "probe"
    facts = await probe(host)
    row.previous, row.current = facts.current, facts.current
    row.device_class = offer.device_class(facts, host.target.name)
    step.name = "build"
    release = await offer.for_device(host, facts, row)
    row.release = release.id
    step.name = "upload"
    await _prepare(host)
    if not await upload.installed(host, _releases(host), release.plan):
        _refuse_live(release, facts)
        _refuse_space(release, facts)
        await _upload(host, release, row)
        step.name = "verify"
        await _verify_and_rename(host, release)
    elif facts.current == release.id:
        row.status, row.reason = ACTIVE, "already active"
        return
    step.name = "activate"
    await _activate(host, release, policy, row)


def _refuse_live(release: Release, facts: Facts) -> None:
    """A live release is never rewritten: `releases/<id>` is current but does not hold this release whole."""
    if facts.current == release.id:
        raise Stop(
            VERIFY_FAILED,
            f"{RELEASES}/{release.id} is live and does not match its SHA256SUMS: a deploy never rewrites the live "
            "release (roll back, then deploy again)",
        )


def _refuse_space(release: Release, facts: Facts) -> None:
    need = 2 * release.plan.bytes
    if facts.free_bytes is None or facts.free_bytes < need:
        free = "unknown" if facts.free_bytes is None else f"{facts.free_bytes / 1e6:.1f} MB"
        raise Stop(REFUSED, f"free space {free} in the deploy root < 2x the release ({need / 1e6:.1f} MB)")


def _root(host: Host) -> str:
    return shlex.quote(host.target.root)


async def _prepare(host: Host) -> None:
    """Create `releases/` in the deploy root (and the root): a target whose root cannot exist fails here."""
    out = await host.run(f"mkdir -p {_root(host)}/{RELEASES}")
    if not out.ok:
        raise Stop(FAILED, f"cannot create {_releases(host)}: {out.tail()}")


def _releases(host: Host) -> str:
    return f"{host.target.root}/{RELEASES}"


async def _upload(host: Host, release: Release, row: TargetResult) -> None:
    """Stage what the target lacks in `releases/<id>.part/`, linking what it has (in a release, an interrupted
    upload, or its engine cache: an engine it built at install time); the row counts what was sent."""
    sent = upload.Sent()
    try:
        await upload.stage(host, _releases(host), release.plan, release.workdir, sent, also=(f"../{DEVICE_CACHE}/*/*",))
    except upload.UploadFailed as err:
        raise Stop(UPLOAD_FAILED, str(err)) from None
    finally:
        row.bytes_sent, row.files_sent, row.files_reused = sent.bytes, sent.files, sent.reused


async def _verify_and_rename(host: Host, release: Release) -> None:
    """Check `.part` on the target once it is on disk, then rename it to `releases/<id>` (synced). A damaged
    directory of the same id is moved aside first, unless it is live: the live release is never rewritten."""
    try:
        await upload.verify(host, _releases(host), release.plan)
    except upload.UploadFailed as err:
        raise Stop(VERIFY_FAILED, str(err)) from None
    live = (f"{host.target.root}/{CURRENT}", f"{RELEASES}/{release.id}")
    try:
        await upload.publish(host, _releases(host), release.plan, live)
    except upload.UploadFailed as err:
        raise Stop(FAILED, str(err)) from None


async def _sums(host: Host, directory: str) -> tuple[Completed, list[str]]:
    """`sha256sum -c SHA256SUMS` in `directory` on the target: its outcome, and the names that did not match."""
    out = await host.run(f"cd {shlex.quote(directory)} && sha256sum -c {SUMS}")
    return out, [line.rsplit(":", 1)[0] for line in out.stdout.splitlines() if not line.endswith(": OK")]


async def verified(host: Host, directory: str) -> str | None:
    """None when every file SHA256SUMS in `directory` lists matches, checked on the target; else what does not."""
    out, bad = await _sums(host, directory)
    if out.ok:
        return None
    return f"{', '.join(bad)}: sha256 does not match {SUMS}" if bad else out.tail()


def activate_command(target: Spot, release_id: str, keep: int) -> str:
    """The remote command that runs a release's activation script, the deploy root's names in its environment."""
    names = [f"{var}={shlex.quote(name)}" for var, name in ACTIVATE_NAMES.items()]
    args = [target.root, release_id, str(keep), target.service, target.health_command]
    script = f"{target.root}/{RELEASES}/{release_id}/{ACTIVATE}"
    return " ".join([*names, "sh", shlex.quote(script), *(shlex.quote(a) for a in args)])


def parse_activation(stdout: str) -> dict[str, str]:
    """The `ACTIVATE key=value` lines of activate.sh."""
    found: dict[str, str] = {}
    for line in stdout.splitlines():
        if line.startswith("ACTIVATE "):
            key, _, value = line[len("ACTIVATE ") :].partition("=")
            found[key] = value
    return found


async def _activate(host: Host, release: Release, policy: Policy, row: TargetResult) -> None:
    out = await host.run(activate_command(host.target, release.id, policy.keep_releases))
    apply_activation(out.stdout, out.tail(), row)


def apply_activation(stdout: str, tail: str, row: TargetResult) -> None:
    """Fold the activation script's report into a result row."""
    report = parse_activation(stdout)
    row.status = report.get("status", FAILED)
    row.current = report.get("current", row.current)
    row.reason = report.get("reason", "") if "status" in report else f"activate.sh: {tail}"
    row.health = _health(report.get("health", ""))
    if row.status == ACTIVE and row.current != row.release:
        row.status, row.reason = FAILED, f"activate.sh said ACTIVE but current is {row.current!r}"


def _health(text: str) -> dict[str, Any]:
    """The health command's `HEALTH <json>` verdict; {} when it printed none (or not a JSON object)."""
    try:
        verdict = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return verdict if isinstance(verdict, dict) else {}


async def switch_back(host: Host, keep: int) -> TargetResult:
    """Make `previous` current again through the previous release's own activate.sh (preflight, switch, post-check
    and pruning as for a deploy); the row's `previous` is then the release that was current."""
    facts = await probe(host)
    row = new_result(host.target, facts.previous)
    row.status, row.current, row.previous = FAILED, facts.current, facts.previous
    if not facts.current or not facts.previous:
        row.reason = "nothing to roll back to (no current and previous release)"
        return row
    if not SAFE_NAME.fullmatch(facts.previous) or ".." in facts.previous:
        # A name read back from a device is checked like one from the inventory before it becomes a path to run.
        row.reason = f"the target reports previous release {facts.previous!r}, not a safe name: not running it"
        return row
    out = await host.run(activate_command(host.target, facts.previous, keep))
    apply_activation(out.stdout, out.tail(), row)
    if row.status == ACTIVE:
        row.status, row.previous = ROLLED_BACK, facts.current
    elif row.status == ROLLED_BACK:
        # activate.sh undid its own switch: the target is back where it was, so the rollback did not happen.
        row.status = FAILED
    return row


async def releases_on(host: Host) -> list[str]:
    """The complete releases in the target's `releases/` (not the `.part` of an upload)."""
    out = await host.run(f'cd {_root(host)}/{RELEASES} 2>/dev/null && for d in */; do echo "${{d%/}}"; done; true')
    return [name for name in out.stdout.split() if SAFE_NAME.match(name) and not name.endswith(PART)]
