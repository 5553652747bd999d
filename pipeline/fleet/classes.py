"""Device classes: declared in `[[build.classes]]`, or derived from what the deploy probe learns about devices.

An engine is valid for one class: GPU compute capability and TensorRT version (the deploy probe names it
`<family>-<sm>-trt<version>`, e.g. orin-sm87-trt10.3.0, and refuses engines of another class).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pydantic import ValidationError

from pipeline.config import BuildClass
from pipeline.errors import PipelineError
from pipeline.files import first_line
from pipeline.fleet.inventory import Inventory, SshTarget
from pipeline.fleet.probe import SOCS, Facts, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Device, Refused


def device_class(sm: str | None, trt_version: str | None) -> str:
    """This host's class, `local-<sm>-trt<version>` when both are known, else plain "local" (an engine of unknown
    provenance). Devices name theirs from the probe (`Facts.device_class`)."""
    if sm and trt_version:
        return f"local-{sm}-trt{trt_version}"
    return "local"


def from_facts(facts: Facts, target: str) -> BuildClass:
    """The class of a probed device, built on that device (builder "device") at the next build."""
    if not facts.tensorrt:
        raise PipelineError(f"{target}: the probe found no TensorRT package (tensorrt, libnvinfer8/10)")
    if facts.soc not in SOCS:
        raise PipelineError(f"{target}: unknown SoC {facts.soc or '(none)'!r} ({facts.model or 'unknown model'})")
    sm = SOCS[facts.soc][1]
    try:
        return BuildClass(
            name=facts.device_class, tensorrt=facts.tensorrt, sm=sm, l4t=facts.l4t, builder="device", target=target
        )
    except ValidationError as err:  # what a device reports is input too: a version like 10.3.0~rc1
        field = ".".join(str(part) for part in err.errors()[0]["loc"])
        raise PipelineError(
            f"{target}: reports a {field} this pipeline cannot use: {err.errors()[0]['input']!r}"
        ) from None


async def probe_target(target: SshTarget) -> Facts:
    """Probe one device (read-only) with the deploy probe script."""
    async with Device(target) as device:
        out = await device.run(probe_script(target.root), timeout_s=30)
    if not out.ok:
        raise PipelineError(f"{target.name}: probe failed: {out.tail()}")
    return parse_facts(out.stdout)


def from_inventory(inventory: Inventory, log: Callable[[str], None] = print) -> list[BuildClass]:
    """One class per distinct device class in the fleet, built on the first device of that class (inventory
    order). An unreachable device, or one whose facts name no class this pipeline knows, is left out, with a log
    line."""

    async def probe_all() -> list[Facts | BaseException]:
        return await asyncio.gather(*(probe_target(t) for t in inventory.targets), return_exceptions=True)

    classes: dict[str, BuildClass] = {}
    for target, facts in zip(inventory.targets, asyncio.run(probe_all()), strict=True):
        if isinstance(facts, (*FAILURES, Refused, PipelineError)):
            why = first_line(facts)
            log(f"[build] {target.name}: not probed ({why})")
            continue
        if isinstance(facts, BaseException):
            raise facts
        try:
            klass = from_facts(facts, target.name)
        except PipelineError as err:
            log(f"[build] {target.name}: left out: {err}")  # reported, not the whole build aborted
            continue
        classes.setdefault(klass.name, klass)
    return list(classes.values())
