"""Checks the deploy tests make on a target's files, independently of the code under test."""

from __future__ import annotations

import subprocess
from pathlib import Path


def verifies(release: Path) -> bool:
    """The release's files all match its SHA256SUMS (`sha256sum -c`, as a device checks them), which lists the model."""
    if not release.is_dir():
        return False
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=release, capture_output=True, text=True)
    listed = {line.rsplit(":", 1)[0] for line in check.stdout.splitlines()}
    return check.returncode == 0 and {"model.onnx", "model.json", "labels.txt", "sample.npz"} <= listed
