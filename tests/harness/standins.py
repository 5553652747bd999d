"""Host-side knobs and call log of one device's stand-in tools (see :mod:`tests.harness.standin_tools`).

The knobs are JSON files in the target's control directory, which the device sees at ``/run/standin``. Each tool
reads them on every call, so a change takes effect at the next call, even on a running device.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .standin_tools import TRTEXEC_DEFAULTS, UNIT_DEFAULTS, unit_name, write_json_atomic


class StandIns:
    """Controls the stand-in `trtexec`, `systemctl` and `dpkg-query` of one device and reads what they were asked."""

    def __init__(self, control_dir: Path) -> None:
        self.dir = control_dir

    def _read(self, name: str) -> dict[str, Any]:
        path = self.dir / name
        return json.loads(path.read_text()) if path.exists() else {}

    def set_trtexec(self, **knobs: Any) -> None:
        """Change trtexec knobs: version, build_exit, load_exit, delay_s, engine_bytes, error, outputs (see
        TRTEXEC_DEFAULTS)."""
        unknown = set(knobs) - set(TRTEXEC_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown trtexec knobs: {sorted(unknown)}")
        write_json_atomic(self.dir / "trtexec.json", {**TRTEXEC_DEFAULTS, **self._read("trtexec.json"), **knobs})

    def set_packages(self, packages: Mapping[str, str | None]) -> None:
        """Set versions `dpkg-query -W` reports; None removes a package ("no packages found matching")."""
        write_json_atomic(self.dir / "dpkg.json", {**self._read("dpkg.json"), **packages})

    def set_unit(self, unit: str, *, restart_exit: int = 0, healthy: bool = True) -> None:
        """Make systemd unit `unit` known: exit code of start/restart, and whether it is active afterwards."""
        config = self._read("systemctl.json")
        units = config.setdefault("units", {})
        units[unit_name(unit)] = {**UNIT_DEFAULTS, "restart_exit": restart_exit, "healthy": healthy}
        write_json_atomic(self.dir / "systemctl.json", config)

    def unit_state(self, unit: str) -> str:
        """State the stand-in systemctl holds for `unit` ("active", "failed", "inactive"), as is-active would say."""
        unit = unit_name(unit)
        known = self._read("systemctl.json").get("units", {})
        if unit not in known:
            return "inactive"
        initial = "active" if known[unit].get("healthy", True) else "failed"
        return self._read("systemctl-state.json").get(unit, initial)

    def reset_state(self) -> None:
        """Forget unit states (units come back in their initial state), as a reboot does."""
        (self.dir / "systemctl-state.json").unlink(missing_ok=True)

    def calls(self, tool: str | None = None) -> list[list[str]]:
        """argv of every stand-in call so far, oldest first (argv[0] is the path it was called by); `tool` filters."""
        path = self.dir / "calls.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [r["argv"] for r in records if tool is None or r["tool"] == tool]

    def clear_calls(self) -> None:
        """Empty the call log, so a test sees only its own calls."""
        (self.dir / "calls.jsonl").unlink(missing_ok=True)
