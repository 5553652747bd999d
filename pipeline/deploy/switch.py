"""The `current` and `previous` symlinks of a target, switched atomically.

A switch is `symlink("releases/<id>", ".current.new")` then one `rename` over `current`: a reader sees the old
release or the new one, never a missing link (`rm` + `ln` is not atomic, and neither is BusyBox `ln -sfn`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fleet.names import safe_name

CURRENT = "current"
PREVIOUS = "previous"


@dataclass(frozen=True)
class Links:
    """Release ids that `current` and `previous` point at (None when the link is absent)."""

    current: str | None
    previous: str | None


def read_link(root: Path, name: str) -> str | None:
    """The release id `root/name` points at; anything but a `releases/<id>` symlink is refused, not touched."""
    link = root / name
    if not link.is_symlink():
        if link.exists():
            raise PipelineError(f"{link}: exists and is not a symlink; refusing to replace it")
        return None
    target = os.readlink(link)
    head, _, release = target.partition("/")
    if head != "releases" or not release:
        raise PipelineError(f"{link}: points at {target!r}, not releases/<id>")
    return safe_name(release, str(link))


def links(root: Path) -> Links:
    """Both links of a target."""
    return Links(read_link(root, CURRENT), read_link(root, PREVIOUS))


def point(root: Path, name: str, release: str | None) -> None:
    """Make `root/name` point at `releases/<release>` in one rename; None removes the link."""
    link = root / name
    if release is None:
        link.unlink(missing_ok=True)
        return
    tmp = root / f".{name}.new"
    tmp.unlink(missing_ok=True)  # left by an interrupted switch
    os.symlink(f"releases/{safe_name(release, 'release id')}", tmp)
    os.replace(tmp, link)


def activate(root: Path, release: str) -> Links:
    """Make `release` current and the old current previous; returns the links as they were before."""
    before = links(root)
    if before.current != release:
        if before.current is not None:
            point(root, PREVIOUS, before.current)
        point(root, CURRENT, release)
    return before


def restore(root: Path, before: Links) -> None:
    """Put both links back as they were (a first release that failed leaves no `current`)."""
    point(root, CURRENT, before.current)
    point(root, PREVIOUS, before.previous)


def swap(root: Path) -> Links:
    """Exchange `current` and `previous` (a rollback); returns the links afterwards."""
    before = links(root)
    if before.current is None or before.previous is None:
        raise PipelineError(f"{root}: nothing to roll back to (current={before.current}, previous={before.previous})")
    point(root, CURRENT, before.previous)
    point(root, PREVIOUS, before.current)
    return Links(before.previous, before.current)
