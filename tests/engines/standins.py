"""Test-side handle of the version-aware stand-in trtexec (tests/engines/standin_trtexec.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StandinTrtexec:
    """A version-aware stand-in trtexec (tests/engines/standin_trtexec.py) and its state directory."""

    exe: Path
    state: Path

    def set(self, version: str | None = None, mode: str | None = None) -> None:
        """Change the TensorRT version it claims and its behaviour (see the script's docstring)."""
        path = self.state / "knobs.json"
        knobs = json.loads(path.read_text()) if path.exists() else {}
        knobs |= {k: v for k, v in (("version", version), ("mode", mode)) if v is not None}
        path.write_text(json.dumps(knobs))

    def calls(self) -> list[list[str]]:
        """argv (without argv[0]) of every call but `--version` probes."""
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def builds(self) -> list[list[str]]:
        """The build calls."""
        return [argv for argv in self.calls() if any(a.startswith("--onnx=") for a in argv)]
