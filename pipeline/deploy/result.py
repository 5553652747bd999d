"""One target's deploy outcome: a typed row with the same fields for a device over SSH and a local target.

`deploy/results.json` holds one `to_dict()` per target; the statuses are the rollout's vocabulary on both paths.
"""

from __future__ import annotations

import io
import shutil
from dataclasses import asdict, dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Column, Table

ACTIVE, ROLLED_BACK, PREFLIGHT_FAILED = "ACTIVE", "ROLLED_BACK", "PREFLIGHT_FAILED"
UNREACHABLE, REFUSED, SKIPPED = "UNREACHABLE", "REFUSED", "SKIPPED"
UPLOAD_FAILED, VERIFY_FAILED, FAILED = "UPLOAD_FAILED", "VERIFY_FAILED", "FAILED"
BUILD_FAILED = "BUILD_FAILED"
"""The install-time engine build (or its verification) failed on the device; nothing there changed."""


class Stop(Exception):
    """Ends one target's deploy with a status and a reason (not an error of the controller)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class TargetResult:
    """What happened on one target. `previous` is the release that was current before, `current` the one after."""

    target: str
    host: str
    """`<host>:<port>` of a device, "local" for a local target."""
    root: str
    release: str
    status: str = SKIPPED
    current: str = ""
    previous: str = ""
    device_class: str = ""
    bytes_sent: int = 0
    files_sent: int = 0
    files_reused: int = 0
    built_on_device: bool = False
    """The device built its class's engine at install time (pipeline.deploy.device_build) during this deploy."""
    build_seconds: float = 0.0
    """How long that build took (0 when the device built nothing)."""
    seconds: float = 0.0
    health: dict[str, Any] = field(default_factory=dict)
    """The verdict a health command printed as `HEALTH <json>` (local targets' check does); {} when none did."""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The row as results.json stores it."""
        return asdict(self)

    @property
    def failed(self) -> bool:
        """Tried and did not end ACTIVE."""
        return self.status not in (ACTIVE, SKIPPED)


def results_table(rows: list[TargetResult]) -> str:
    """Per-target outcome as text (status, device class, bytes sent, seconds, health, reason)."""
    table = Table(
        Column("target", overflow="fold"),
        *(Column(name, no_wrap=True) for name in ("status", "class", "sent", "seconds", "health")),
        Column("reason", overflow="fold"),
        box=box.SIMPLE_HEAD,
    )
    for r in rows:
        health = "-" if not r.health else "passed" if r.health.get("passed") else "FAILED"
        sent = f"{r.bytes_sent / 1e6:.2f} MB"
        table.add_row(r.target, r.status, r.device_class or "-", sent, f"{r.seconds:.2f}", health, r.reason)
    buffer = io.StringIO()
    # Rendered to text so any `log` callable can show it, at least 100 columns wide: a narrower table would fold
    # the reason into many lines, and a wider text would be wrapped again by whoever prints it.
    Console(file=buffer, width=max(100, shutil.get_terminal_size((120, 24)).columns), color_system=None).print(table)
    return buffer.getvalue().rstrip()
