"""Names that become path components on a device (targets, classes, releases, files): checked in one place."""

from __future__ import annotations

import re

from pipeline.errors import PipelineError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""No separators, no leading dot, at most 128 characters; `..` is refused separately."""


def safe_name(name: str, what: str) -> str:
    """`name` if it is safe as one path component on a target, else a PipelineError naming `what`."""
    if not SAFE_NAME.match(name) or ".." in name:
        raise PipelineError(f"{what}: {name!r} is not a safe name (letters, digits, '.', '_', '-'; no '..')")
    return name
