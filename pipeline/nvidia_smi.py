"""One `nvidia-smi --query-gpu` reading, for the hosts where torch cannot tell (no CUDA build, a Jetson's tools)."""

from __future__ import annotations

import shutil
import subprocess


def query(field: str, timeout_s: float = 10.0) -> list[str]:
    """Values of `field` (e.g. "compute_cap", "temperature.gpu"), one per GPU; [] without nvidia-smi or on error."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
