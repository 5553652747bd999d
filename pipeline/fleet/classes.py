"""Device classes: declared in `[[build.classes]]`, or derived from what the deploy probe learns about devices.

An engine is valid for one class: GPU compute capability and TensorRT version. `DeviceClass` names it
`<family>-<sm>-trt<version>`, e.g. orin-sm87-trt10.3.0 for a probed device (deploy refuses engines of another class)
and local-sm87-trt10.3.0 for this host, and reads such a name back; a declared class may be named anything.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.config import BuildClass
from pipeline.errors import PipelineError
from pipeline.files import first_line
from pipeline.fleet.inventory import Inventory, SshTarget
from pipeline.fleet.probe import SOCS, Facts, parse_facts, probe_script
from pipeline.fleet.ssh import FAILURES, Device, Refused

LOCAL = "local"
"""The family of this host's class, and its whole name while its GPU or TensorRT version is unknown."""
UNKNOWN = "unknown"
"""The family of a probed device whose SoC this pipeline does not know."""
_NAME = re.compile(r"(?P<family>[A-Za-z0-9][A-Za-z0-9._-]*?)-(?P<sm>sm\d+|sm\?)-trt(?P<tensorrt>\d+(?:\.\d+)*|\?)")
_VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?")
"""A TensorRT version a class can carry: the form [[build.classes]] takes and the probe reduces a package to."""
QUOTED_CHARS = 40
"""Characters of a device-reported value a message quotes (a device may report anything, 500 characters too)."""


@dataclass(frozen=True)
class DeviceClass:
    """The machines an engine loads on, named `<family>-<sm>-trt<version>` (`str`) and read back by `parse`.

    An unknown part is "" and named `sm?` / `trt?` (a probed device without a TensorRT package: orin-sm87-trt?); this
    host's class with an unknown part is plain `local` (an engine of unknown provenance).
    """

    family: str
    """`local` for this host, else the probed SoC's family (`orin`, `xavier`, ..., `unknown`)."""
    sm: str = ""
    """CUDA compute capability, e.g. `sm87`."""
    tensorrt: str = ""
    """TensorRT version, e.g. `10.3.0`."""

    def __str__(self) -> str:
        if self.family == LOCAL and not (self.sm and self.tensorrt):
            return LOCAL
        return f"{self.family}-{self.sm or 'sm?'}-trt{self.tensorrt or '?'}"

    @classmethod
    def this_host(cls, sm: str | None, tensorrt: str | None) -> DeviceClass:
        """This host's class: `local-<sm>-trt<version>` when both are known, else `local`."""
        return cls(LOCAL, sm or "", tensorrt or "") if sm and tensorrt else cls(LOCAL)

    @classmethod
    def probed(cls, facts: Facts) -> DeviceClass:
        """A probed device's class, from its SoC (family and GPU) and its TensorRT package."""
        family, sm = SOCS.get(facts.soc, (UNKNOWN, ""))
        return cls(family, sm, facts.tensorrt)

    @classmethod
    def parse(cls, text: str) -> DeviceClass:
        """The class `text` names (as `str` wrote it); a PipelineError when it names none."""
        if text == LOCAL:
            return cls(LOCAL)
        match = _NAME.fullmatch(text)
        if match is None:
            raise PipelineError(
                f"{text!r} is not a device class name (<family>-sm<N>-trt<version>, e.g. orin-sm87-trt10.3.0, or local)"
            )
        sm, tensorrt = match["sm"], match["tensorrt"]
        return cls(match["family"], "" if sm == "sm?" else sm, "" if tensorrt == "?" else tensorrt)


def quoted(value: str) -> str:
    """A value a device reported, fit for a one-line message: its repr (no control character, newline or bare quote
    gets through) of at most QUOTED_CHARS characters."""
    return repr(value if len(value) <= QUOTED_CHARS else value[:QUOTED_CHARS] + "...")


def checked(facts: Facts, target: str) -> DeviceClass:
    """The probed device's class, only when what it reported can name one: a PipelineError naming `target` when its
    TensorRT version is not plain numbers (a prerelease like 10.3.0~rc1, `$(id)`, any other text), which then never
    becomes part of a class name, a directory name or a command."""
    if facts.tensorrt and not _VERSION.fullmatch(facts.tensorrt):
        raise PipelineError(
            f"{target}: reports TensorRT {quoted(facts.tensorrt)}, not a version this pipeline can use "
            "(<major>.<minor>[.<patch>])"
        )
    return DeviceClass.probed(facts)


def host_class(name: str) -> DeviceClass | None:
    """The class `name` names when it is this host's (`local`, `local-<sm>-trt<version>`), else None: a probed
    device's, or a declared class's (declared names need not be device class names at all)."""
    try:
        klass = DeviceClass.parse(name)
    except PipelineError:
        return None
    return klass if klass.family == LOCAL else None


def from_facts(facts: Facts, target: str) -> BuildClass:
    """The class of a probed device, built on that device (builder "device") at the next build."""
    if not facts.tensorrt:
        raise PipelineError(f"{target}: the probe found no TensorRT package (tensorrt, libnvinfer8/10)")
    if facts.soc not in SOCS:
        raise PipelineError(f"{target}: unknown SoC {quoted(facts.soc or '(none)')} ({quoted(facts.model or '?')})")
    klass = checked(facts, target)
    return BuildClass(
        name=str(klass), tensorrt=facts.tensorrt, sm=klass.sm, l4t=facts.l4t, builder="device", target=target
    )


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
