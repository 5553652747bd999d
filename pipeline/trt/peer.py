"""A second device's opinion on an engine a device built: what lets that engine leave the device that made it.

A device's trtexec is trusted with its own device only. An engine built on a device (or kept in its cache) reaches the
engine cache, the run's `engines/<class>/` and the class's other devices only once another device of the same class
(GPU and TensorRT version, as probed) loaded it with its own trtexec and matched ONNX Runtime on the stored sample.
That device checks the very bytes the controller fetched from the builder and hashed (its own `sha256sum` must agree),
and those bytes are what gets published. A device whose engine a peer rejected verifies nothing more in that deploy
or build.

Without a second device of the class there is no second opinion: the builder may run its own engine, but it is shared
with nobody, and its build.json says UNVERIFIED.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.files import first_line, sha256_file
from pipeline.fleet.classes import DeviceClass, checked, probe_target
from pipeline.fleet.inventory import SshTarget
from pipeline.fleet.ssh import FAILURES, Device, Refused
from pipeline.layout import PLAN
from pipeline.trt import engine_job
from pipeline.trt.engine_job import Job
from pipeline.trt.runners import Remote

UNVERIFIED = "unverified by a peer"
"""build.json's `peer_check` for an engine no second device of its class verified (it is shared with nobody)."""


class CannotVerify(Exception):
    """This peer gave no verdict (unreachable, or the engine did not arrive whole): the next one is asked."""


@dataclass
class Peers:
    """The inventory's devices as verifiers of each other's engines (probed once, when first asked)."""

    targets: Sequence[SshTarget]
    timeout_s: int
    """Limit for each command on a peer (a load with trtexec takes build.timeout_s at most)."""
    max_parallel: int
    """Probes at once (the fleet's policy.max_parallel)."""
    log: Callable[[str], None] = print
    suspects: set[str] = field(default_factory=set)
    """Devices whose engine a peer rejected: their verdicts count for nothing."""
    _classes: dict[str, DeviceClass | None] | None = None

    async def of_class(self, klass: DeviceClass, builder: str) -> list[SshTarget]:
        """Devices of `klass` other than `builder` and the suspects, in inventory order."""
        if self._classes is None:
            limit = asyncio.Semaphore(self.max_parallel)
            found = await asyncio.gather(*(self._probe(t, limit) for t in self.targets))
            self._classes = {t.name: k for t, k in zip(self.targets, found, strict=True)}
        excluded = {builder, *self.suspects}
        return [t for t in self.targets if self._classes.get(t.name) == klass and t.name not in excluded]

    async def _probe(self, target: SshTarget, limit: asyncio.Semaphore) -> DeviceClass | None:
        try:
            async with limit:
                return checked(await probe_target(target), target.name)
        except (*FAILURES, Refused, PipelineError) as err:
            self.log(f"[peer] {target.name}: not probed, verifies nothing: {first_line(err)}")
            return None

    async def verify(
        self, klass: DeviceClass, builder: str, exe: str, job: Job, sample: Path
    ) -> tuple[str, dict[str, Any]] | None:
        """(peer, its checks) for the engine in `job.staging`, built on `builder`: the first device of `klass` that
        gives a verdict; None when none does. A rejection is a PipelineError naming both devices, and makes `builder`
        a suspect."""
        for peer in await self.of_class(klass, builder):
            try:
                checks = await _check_on(peer, exe, job, sample, self.timeout_s)
            except CannotVerify as why:
                self.log(f"[peer] {peer.name}: cannot verify the engine built on {builder}: {why}")
                continue
            except PipelineError as err:
                self.suspects.add(builder)
                raise PipelineError(
                    f"{job.klass}: the engine built on {builder} was rejected by {peer.name}, another device of the "
                    f"class ({err}): not used, not shared"
                ) from None
            return peer.name, checks
        return None


async def _check_on(peer: SshTarget, exe: str, job: Job, sample: Path, timeout_s: int) -> dict[str, Any]:
    """Send the engine to `peer` and check it there with its trtexec (its own staging directory for the logs)."""
    sha256 = sha256_file(job.staging / PLAN)
    own = replace(job, staging=job.staging / f"peer-{peer.name}")
    own.staging.mkdir(exist_ok=True)
    try:
        async with Device(peer, command_timeout_s=timeout_s) as device:
            runner = Remote(device, exe)
            try:
                await _opened(runner)
                await runner.put(job.staging / PLAN, PLAN)
                if await runner.sha256(PLAN) != sha256:
                    raise CannotVerify("the engine it holds does not match the sha256 fetched from the builder")
                return await engine_job.check(runner, own, sample if sample.is_file() else None)
            finally:
                await runner.close()
    except (*FAILURES, Refused) as err:
        raise CannotVerify(first_line(err, typed=True)) from None


async def _opened(runner: Remote) -> None:
    """The peer's work directory; a peer that cannot make one gives no verdict (it says nothing of the engine)."""
    try:
        await runner.open()
    except PipelineError as err:
        raise CannotVerify(str(err)) from None


def vouched(info: dict[str, Any], verdict: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """build.json with a peer's verdict (`Peers.verify`): the device that verified the engine and its checks, or
    UNVERIFIED."""
    if verdict is None:
        return {**info, "verified_by": None, "peer_check": UNVERIFIED}
    peer, checks = verdict
    return {**info, "verified_by": peer, "peer_check": checks}


def shared(info: dict[str, Any]) -> bool:
    """Whether an engine may go beyond the device that built it: built here, or verified by a second device."""
    return info.get("builder") != "device" or bool(info.get("verified_by"))


def private_to(info: dict[str, Any]) -> str | None:
    """The one device that may run an engine no peer verified (the one that built it); None for a shared engine."""
    return None if shared(info) else str(info.get("built_by") or info.get("target") or "")
