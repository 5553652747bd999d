"""The durability checker itself, on real shell commands traced by strace: it must flag what is not on disk in time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.durability import publishes, strace, unsynced_publishes

STAGE = "mkdir -p releases/r.part && echo data >releases/r.part/f.tmp && mv releases/r.part/f.tmp releases/r.part/f"
SYNC_PART = "sync -- releases/r.part releases/r.part/f"
PUBLISH = "mv releases/r.part releases/r"
SYNC_RELEASES = "sync -- releases"
SWITCH = "ln -s releases/r .current.new && mv -T .current.new current"
SYNC_ROOT = "sync -- ."


def findings(tmp_path: Path, *steps: str) -> list[str]:
    """What the checker says of `steps` run in order by one shell in a fresh directory (relative to it)."""
    root = tmp_path / "root"
    root.mkdir()
    log = tmp_path / "trace"
    assert strace(["sh", "-ec", " && ".join(steps)], log, cwd=root).returncode == 0
    assert publishes(log, root) >= 2  # the release, and current when switched
    return [line.replace(f"{root}/", "").replace(str(root), "ROOT") for line in unsynced_publishes(log, root)]


def test_a_synced_release_and_switch_pass(tmp_path: Path):
    assert findings(tmp_path, STAGE, SYNC_PART, PUBLISH, SYNC_RELEASES, SWITCH, SYNC_ROOT) == []


def test_a_file_fsynced_under_its_temp_name_before_the_rename_counts_as_synced(tmp_path: Path):
    """What `pipeline.files.publish` does for each file it puts into a `.part` (Device.get of a checkpoint file)."""
    durable_file = STAGE.replace(" && mv", " && sync -- releases/r.part/f.tmp && mv")
    assert findings(tmp_path, durable_file, "sync -- releases/r.part", PUBLISH, SYNC_RELEASES, SWITCH, SYNC_ROOT) == []


def test_plain_sync_covers_what_came_before_it(tmp_path: Path):
    assert findings(tmp_path, STAGE, "sync", PUBLISH, "sync", SWITCH, "sync") == []


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (
            ("sync", STAGE, PUBLISH, SYNC_RELEASES, SWITCH, SYNC_ROOT),  # a sync before the upload covers nothing of it
            [
                "releases/r.part -> releases/r: f not synced",
                "releases/r.part -> releases/r: releases/r.part (its entries) not synced",
            ],
        ),
        (
            (STAGE, SYNC_PART, PUBLISH, SWITCH, SYNC_ROOT, SYNC_RELEASES),  # the release's rename synced too late
            [".current.new -> current: points at releases/r, whose rename into place was not synced before the switch"],
        ),
        (
            (STAGE, SYNC_PART, PUBLISH, SYNC_RELEASES, SWITCH),  # the switch itself never synced
            [".current.new -> current: ROOT not synced after the rename"],
        ),
    ],
)
def test_what_is_not_on_disk_in_time_is_named(tmp_path: Path, steps: tuple[str, ...], expected: list[str]):
    assert findings(tmp_path, *steps) == expected
