"""Training on a cluster of devices over SSH, from this machine (the controller), with no shared filesystem.

The controller checks every device (:func:`check`: Python, torch, packages, code version), ships its own code to
them (a zip of the `pipeline` and `models` packages, sent with the fleet's verified, deduplicating upload, so an
unchanged version sends nothing), hosts the rendezvous store itself, on its loopback, and starts one torchrun agent
per device, each with `--rdzv-conf is_host=0` (docs/torch-distributed.md#choosing-the-rendezvous-host): the job
depends on no one device. The devices reach the store through their SSH connections (a remote port forward), and
their ranks meet there too: nothing the job starts listens on the network but gloo (docs/security.md). Each device
trains into a run directory on its own disk; the controller copies every complete checkpoint back as it is
committed, so the controller's run directory always holds the newest checkpoint that is whole.

Membership is the controller's: a job runs in rounds of a fixed node set. When a device disappears, the round ends
on every device, and the next round starts with the devices left (if `train.devices`' minimum still holds) from the
last complete checkpoint, which the controller first sends to each of them; torchrun's own restart would resume
each rank from its own disk, which holds only that device's shards. A device that comes back is taken in at the
next checkpoint. `summary.json` and `metrics.jsonl` record who left or joined, when, and the steps lost.

The dataset is read on each device's own disk or sent there first (`data.sync`): :mod:`pipeline.train.cluster.nodedata`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shlex
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pipeline
from pipeline.errors import PipelineError
from pipeline.files import parse_json
from pipeline.fleet import devicecheck, upload
from pipeline.fleet.inventory import Inventory, SshTarget
from pipeline.fleet.ssh import FAILURES, Device, Refused

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 5)
CHECK_TIMEOUT_S = 180
CODE_ZIP = "code.zip"


# --- the code the devices run -----------------------------------------------------------------------------------


def code_bundle(workdir: Path) -> upload.Bundle:
    """This controller's code as a bundle named by its version: one zip, the same bytes for the same files."""
    base = Path(pipeline.__file__).resolve().parent.parent
    files = sorted(
        rel
        for package in devicecheck.CODE_PACKAGES
        for path in (base / package).rglob("*")
        if path.is_file() and devicecheck.is_code_file(rel := path.relative_to(base).as_posix())
    )
    entries = [(rel, hashlib.sha256((base / rel).read_bytes()).hexdigest()) for rel in files]
    version = devicecheck.code_version(entries)
    archive = workdir / f"{version}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel in files:
            info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: the zip's sha256 is the content's
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            zf.writestr(info, (base / rel).read_bytes())
    return upload.bundle(version, {CODE_ZIP: archive})


def run_key(run_dir: Path) -> str:
    """The run's directory name on every device: the controller's, unique per controller path, and of characters no
    shell reads as syntax (the name comes from a config or a Prefect parameter)."""
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:64]
    return f"{safe_name}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"


def code_dir(target: SshTarget) -> str:
    """Where shipped code versions live on the device."""
    return f"{target.root}/train/code"


def python_path(target: SshTarget, version: str) -> str:
    """What goes on the device's PYTHONPATH: the shipped zip, or the directory `code` names."""
    return f"{code_dir(target)}/{version}/{CODE_ZIP}" if target.code == "ship" else target.code


# --- checking the devices ---------------------------------------------------------------------------------------


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:2])


def problems(facts: dict[str, Any], version: str, python: str) -> list[str]:
    """What keeps a device from training, each a short clause; empty when it is ready."""
    found = []
    if _version(facts.get("python", "0")) < MIN_PYTHON:
        found.append(f"Python {facts.get('python')} ({python}) is older than 3.10")
    if facts.get("torch") and _version(facts["torch"]) < MIN_TORCH:
        found.append(f"torch {facts['torch']} is older than 2.5")
    if facts.get("torch") and facts.get("backends") == []:
        found.append(f"torch {facts['torch']} was built without torch.distributed")
    if facts.get("missing"):
        found.append(f"missing Python packages {', '.join(facts['missing'])}: install with `{install(facts, python)}`")
    if facts.get("code_version") != version:
        where = facts.get("code_path") or "nothing importable"
        found.append(f"runs code {facts.get('code_version') or '-'} ({where}), not the controller's {version}")
    return found


def install(facts: dict[str, Any], python: str) -> str:
    """The command that installs what is missing (torch itself: NVIDIA's wheel for the JetPack, as
    docs/how-to/install-on-device.md says)."""
    if not facts.get("missing"):
        return ""
    return f"{python} -m pip install --user " + " ".join(shlex.quote(req) for req in facts["missing"])


@dataclass
class NodeCheck:
    """One device as checked: its facts and what keeps it from training."""

    target: SshTarget
    status: str = "unreachable"
    facts: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    bytes_sent: int = 0

    def row(self) -> dict[str, Any]:
        """The `pipeline cluster check` row."""
        f = self.facts
        return {
            "target": self.target.name,
            "status": self.status,
            "python": f.get("python"),
            "torch": f.get("torch"),
            "cuda": f.get("cuda"),
            "gpu": f.get("gpu"),
            "backends": " ".join(f.get("backends", [])),
            "mem_free": _mb(f.get("mem_free")),
            "disk_free": _mb(f.get("disk_free")),
            "power_mode": f.get("power_mode"),
            "gpu_mhz": f.get("gpu_mhz"),
            "cpu0_mhz": f.get("cpu0_mhz"),
            "code": f.get("code_version"),
            "missing": " ".join(f.get("missing", [])),
            "install": install(f, self.target.python),
            "bytes_sent": self.bytes_sent,
            "reason": self.reason,
        }


def _mb(value: int | None) -> str:
    return "" if value is None else f"{value / 1e6:.0f} MB"


async def _inspect(dev: Device, code: upload.Bundle, workdir: Path, node: NodeCheck) -> None:
    """Ship the code (when `code = "ship"`), then run the device check with it on the path."""
    target = dev.target
    if target.code == "ship":
        node.bytes_sent = (await upload.send(dev, code_dir(target), code, workdir)).bytes
    script = Path(devicecheck.__file__).read_text()
    env = f"PYTHONPATH={shlex.quote(python_path(target, code.id))}"
    out = await dev.run(f"{env} {target.python} - {shlex.quote(target.root)}", CHECK_TIMEOUT_S, stdin=script)
    report = [line for line in out.stdout.splitlines() if line.startswith("DEVICECHECK ")]
    if not report:
        node.status, node.reason = "refused", f"{target.python}: {out.tail()}"
        return
    try:
        node.facts = parse_json(report[-1].removeprefix("DEVICECHECK "), "its device check")
    except PipelineError as err:
        node.status, node.reason = "refused", str(err)
        return
    if not isinstance(node.facts, dict):
        node.status, node.reason, node.facts = "refused", "its device check printed no JSON object", {}
        return
    found = problems(node.facts, code.id, target.python)
    node.status, node.reason = ("refused", "; ".join(found)) if found else ("ready", "")


async def check_one(target: SshTarget, code: upload.Bundle, workdir: Path) -> NodeCheck:
    """Check one device; never raises for device-side problems (they are the row's status and reason)."""
    node = NodeCheck(target)
    try:
        async with Device(target, command_timeout_s=CHECK_TIMEOUT_S) as dev:
            await _inspect(dev, code, workdir, node)
    except Refused as err:  # the device's host key, or the controller's own key
        node.status, node.reason = "refused", str(err)
    except upload.UploadFailed as err:
        node.status, node.reason = "refused", f"code upload: {err}"
    except FAILURES as err:
        node.status, node.reason = "unreachable", f"{type(err).__name__}: {err}".rstrip(": ")
    return node


async def check_all(inventory: Inventory, code: upload.Bundle, workdir: Path) -> list[NodeCheck]:
    """Check every device of the inventory at once."""
    return list(await asyncio.gather(*(check_one(t, code, workdir) for t in inventory.targets)))


def check(inventory: Inventory) -> list[NodeCheck]:
    """`pipeline cluster check`: every device checked (and the code shipped to those that take it)."""
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
        code = code_bundle(Path(tmp))
        return asyncio.run(check_all(inventory, code, Path(tmp)))


FSDP_ON_CPU_TORCH = (2, 6)
"""The first torch whose FSDP2 trains without CUDA (docs/torch-distributed.md#fsdp2-before-26)."""


def refuse_unready(nodes: list[NodeCheck], strategy: str = "ddp") -> None:
    """One line naming the first device that cannot train, or cannot run `strategy`, and why (exit 2): nothing has
    started anywhere."""
    for node in nodes:
        if node.status != "ready":
            raise PipelineError(f"{node.target.name}: {node.status}: {node.reason}")
        torch = node.facts.get("torch", "0")
        if strategy == "fsdp" and not node.facts.get("gpu") and _version(torch) < FSDP_ON_CPU_TORCH:
            raise PipelineError(
                f"{node.target.name}: refused: train.strategy=fsdp needs a GPU with torch {torch} "
                "(its FSDP2 runs on a CPU from torch 2.6); use ddp"
            )


def choose_backend(nodes: list[NodeCheck], wanted: str) -> str:
    """The process-group backend every device's ranks use (`train.backend`): `auto` is nccl when every device has a
    GPU and a torch built with NCCL, gloo otherwise (NVIDIA's torch for JetPack has no NCCL: docs/torch-distributed.md
    #no-nccl-on-jetson); nccl where a device cannot is one line naming it (exit 2), before anything starts."""
    for node in nodes:
        lacks = lacks_nccl(node)
        if lacks and wanted == "nccl":
            raise PipelineError(f"train.backend: nccl, but {node.target.name} {lacks}; use gloo or auto")
        if lacks:
            return "gloo"
    return "gloo" if wanted == "gloo" else "nccl"


def lacks_nccl(node: NodeCheck) -> str:
    """Why the device cannot train on nccl, or "" when it can."""
    if not node.facts.get("gpu"):
        return "has no GPU"
    if "nccl" not in node.facts.get("backends", []):
        return f"runs torch {node.facts.get('torch')}, built without NCCL (as NVIDIA's torch for JetPack is)"
    return ""


def refusal(target: SshTarget, err: Refused) -> PipelineError:
    """The one line for a device the controller will not log in to (its host key, or the controller's own key), said
    as :func:`refuse_unready` says it for a device refused at the check."""
    return PipelineError(f"{target.name}: refused: {err}")


# --- bounds -----------------------------------------------------------------------------------------------------


def bounds(spec: str | None, available: int) -> tuple[int, int]:
    """(minimum, maximum) devices from `train.devices` ("3" or "2:4"); unset: all of them, none may leave."""
    if spec is None:
        return available, available
    low, _, high = spec.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise PipelineError(f"train.devices: {spec!r}: needs 1 <= min <= max")
    if lo > available:
        raise PipelineError(f"train.devices: {spec!r} needs at least {lo} devices; the inventory lists {available}")
    return lo, min(hi, available)
