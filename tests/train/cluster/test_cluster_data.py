"""The dataset of cluster training over SSH, against stand-in Jetsons (tests/harness): sent once from the controller
(`data.sync = true`), or read from each device's own disk, with the run's data fingerprint covering every device.

The stand-ins' /tmp is their own, so a folder under the test's tmp_path is not visible on any device: a device that
trains on it must have been sent it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.files import read_json
from tests import photos
from tests.harness import JetsonFleet
from tests.train.cluster.test_cluster import (
    forwarding,
    inventory,
    jetson_fleet,
    marked_processes,
    run_cli,
    start_cluster,
)

__all__ = ["forwarding", "jetson_fleet"]  # fixtures, used by name

FAST = ("--set", "train.epochs=1", "--set", "data.source=imagefolder", "--set", "data.image_size=16")


def train(inv: Path, run_dir: Path, data_path: Path | str, *extra: str) -> dict:
    """`pipeline train --inventory` on the folder; returns summary.json (asserting exit 0)."""
    args = ("--set", f"data.path={json.dumps(str(data_path))}", *FAST, *extra)
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), *args, cwd=run_dir.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_json(run_dir / layout.SUMMARY)


def device_tree(fleet: JetsonFleet, name: str, bundle_id: str) -> dict[str, bytes]:
    """The folder a device trained on, as relative path → content."""
    root = fleet[name].disk / "train/data/sets" / bundle_id
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def folder_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow  # three short cluster runs
def test_sync_sends_the_folder_once_and_then_only_what_changed(jetson_fleet, forwarding, tmp_path: Path) -> None:
    folder = photos.sample_tiles(tmp_path / "photos")
    size = sum(len(b) for b in folder_files(folder).values())
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    sync = ("--set", "data.sync=true")
    for target in fleet:
        assert target.run(f"test -e {folder}", check=False).returncode != 0  # the devices cannot see it

    first = train(inv, tmp_path / "first", folder, *sync)
    assert first["data"]["mode"] == "sent" and first["world_size"] == 2
    assert first["bytes_sent"]["data"] >= 2 * size  # every image, to both devices
    for target in fleet:
        assert device_tree(fleet, target.name, first["data"]["id"]) == folder_files(folder)

    again = train(inv, tmp_path / "again", folder, *sync)
    assert again["data"] == first["data"]
    assert again["bytes_sent"]["data"] == 0 and again["bytes_sent"]["code"] == 0

    added = folder / "flower" / "99.png"
    shutil.copy(folder / "china" / "00.png", added)  # bytes a device already holds, under a new name
    (folder / "china" / "01.jpg").write_bytes((folder / "china" / "01.jpg").read_bytes() + b"\0" * 4096)
    third = train(inv, tmp_path / "third", folder, *sync)
    assert third["data"]["id"] != first["data"]["id"]
    changed = (folder / "china" / "01.jpg").stat().st_size
    # Only the changed image travels (and the index and checksums): the copied one is linked on the device.
    assert 2 * changed <= third["bytes_sent"]["data"] < 2 * (changed + 16_384)
    for target in fleet:
        assert device_tree(fleet, target.name, third["data"]["id"]) == folder_files(folder)
        assert [p.name for p in (target.disk / "train/data/sets").iterdir()] == [third["data"]["id"]]
    assert marked_processes(fleet) == []


@pytest.mark.slow  # three short cluster runs
def test_node_local_data_is_fingerprinted_on_every_device(jetson_fleet, forwarding, tmp_path: Path) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    inv = inventory(fleet)
    where = "/opt/edge/photos"  # the same path on each device's own disk; the controller has no such folder
    for target in fleet:
        photos.sample_tiles(target.disk / "photos")
    run_dir = tmp_path / "run"
    first = train(inv, run_dir, where)
    assert first["data"]["mode"] == "node" and sorted(first["data"]["nodes"]) == ["node-1", "node-2"]
    assert {n["images"] for n in first["data"]["nodes"].values()} == {12}

    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), "--set",
                  f"data.path={json.dumps(where)}", *FAST, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0 and "[train] cached" in out.stdout + out.stderr, out.stderr[-2000:]

    extra = fleet["node-2"].disk / "photos" / "flower" / "99.png"
    shutil.copy(fleet["node-2"].disk / "photos" / "flower" / "00.png", extra)
    second = train(inv, run_dir, where)  # one device's folder changed: not cached, trained again
    assert second["data"]["fingerprint"] != first["data"]["fingerprint"]
    nodes, before = second["data"]["nodes"], first["data"]["nodes"]
    assert nodes["node-1"] == before["node-1"]
    assert nodes["node-2"]["fingerprint"] != before["node-2"]["fingerprint"] and nodes["node-2"]["images"] == 13
    manifest = read_json(run_dir / "manifest.json")
    assert manifest["stages"]["train"]["inputs"]["data"] == second["data"]["fingerprint"]

    (fleet["node-1"].disk / "photos" / "china").rename(fleet["node-1"].disk / "photos" / "temple")
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(tmp_path / "other"), "--set",
                  f"data.path={json.dumps(where)}", *FAST, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "same class folders" in out.stderr and "node-" in out.stderr
    assert marked_processes(fleet) == []


def test_node_sampler_shares_a_devices_images_among_its_ranks_in_equal_steps() -> None:
    """Node-local data: the device's ranks split its images without overlap, take as many as the smallest device's
    share allows (so every rank of the job runs as many steps), and draw other images in the next epoch."""
    from pipeline.train.rank.sampling import NodeSampler

    ranks = [NodeSampler(13, 5, 2, rank, seed=0) for rank in range(2)]
    first = [list(r) for r in ranks]
    assert [len(r) for r in ranks] == [5, 5] and [len(x) for x in first] == [5, 5]
    assert not set(first[0]) & set(first[1]) and set(first[0] + first[1]) <= set(range(13))
    for r in ranks:
        r.set_epoch(1)
    assert [list(r) for r in ranks] != first
