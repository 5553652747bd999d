"""Faults on the cluster path that used to end in a traceback, replayed against stand-in Jetsons (tests/harness): a
controller key the device cannot be logged in to with, a device whose disk cannot take what training sends it, and
an image folder holding symbolic links."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import asyncssh
import numpy as np
import pytest
from PIL import Image

from pipeline import data, layout
from pipeline.config import load_config
from pipeline.errors import PipelineError
from pipeline.files import read_json
from pipeline.fleet.inventory import SshTarget, load_inventory
from pipeline.fleet.ssh import LINK_TIMEOUT_S, Device
from pipeline.train.cluster import NodeCheck, nodedata
from pipeline.train.cluster.node import Node
from pipeline.train.cluster.rounds import node_data
from tests import photos
from tests.train.cluster.test_cluster import (
    forwarding,
    inventory,
    jetson_fleet,
    marked_processes,
    run_cli,
    start_cluster,
)
from tests.train.cluster.test_cluster_data import FAST

__all__ = ["forwarding", "jetson_fleet"]  # fixtures, used by name


def bad_keys(where: Path) -> tuple[Path, Path]:
    """A garbage private key file and a passphrase-protected one (the controller has no passphrase to give)."""
    garbage, encrypted = where / "id_garbage", where / "id_encrypted"
    garbage.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----\n")
    # PKCS#8: OpenSSH's own encrypted format needs bcrypt, which this venv lacks (asyncssh refuses both alike).
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(
        str(encrypted), format_name="pkcs8-pem", passphrase="secret"
    )
    for key in (garbage, encrypted):
        key.chmod(0o600)
    return garbage, encrypted


def assert_one_line(out: subprocess.CompletedProcess[str], pattern: str) -> None:
    """Exit 2, and stderr is one line matching `pattern` (no traceback)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert re.match(pattern, lines[0]), lines[0]


def test_an_unusable_client_key_is_a_refused_row_and_one_line(jetson_fleet, forwarding, tmp_path: Path) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    garbage, encrypted = bad_keys(tmp_path)
    inv = inventory(fleet, tmp_path / "keys.toml", node_1={"key": str(garbage)}, node_2={"key": str(encrypted)})
    out = run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path)
    assert_one_line(out, rf"error: node-1: refused: key {garbage}: not a usable private key")
    rows = {row["target"]: row for row in json.loads(out.stdout)}
    assert [row["status"] for row in rows.values()] == ["refused", "refused"]
    assert rows["node-1"]["reason"].startswith(f"key {garbage}: not a usable private key")
    assert rows["node-2"]["reason"].startswith(f"key {encrypted}: not a usable private key")

    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inv), "--run-dir", str(run_dir), cwd=tmp_path)
    assert_one_line(out, rf"error: node-1: refused: key {garbage}: not a usable private key")
    assert not (run_dir / layout.TRAIN_DIR).exists()
    assert marked_processes(fleet) == []


def test_opening_a_device_later_with_an_unusable_key_is_one_line(tmp_path: Path) -> None:
    """The job's own connections (its devices, their node-local data) refuse such a key as the check does: the key
    is read before any connection, so no device is needed."""
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    for key in bad_keys(tmp_path):
        target = SshTarget(name="node-9", host="127.0.0.1", port=9, key=key, known_hosts=known_hosts)
        expected = rf"^node-9: refused: key {key}: not a usable private key"
        with pytest.raises(PipelineError, match=expected):
            asyncio.run(Node.connect(NodeCheck(target), "run-key", 1, LINK_TIMEOUT_S))
        with pytest.raises(PipelineError, match=expected):
            asyncio.run(node_data([target], load_config(), "code-id"))


def test_a_device_report_nested_too_deeply_is_one_line(jetson_fleet, forwarding, tmp_path: Path) -> None:
    """The device check's and the data report's JSON, read from the device's output, as a device that misbehaves
    could print them: a refused row and one line, as for malformed input anywhere else."""
    fleet = start_cluster(jetson_fleet, 1)
    device = fleet["node-1"]
    (device.disk / "deep.json").write_text("[" * 5000 + "]" * 5000)
    (device.disk / "python").write_text(
        "#!/bin/sh\nprintf 'DEVICECHECK '; cat /opt/edge/deep.json; printf '\\nNODEDATA '; cat /opt/edge/deep.json\n"
    )
    (device.disk / "python").chmod(0o755)
    inv = inventory(fleet, tmp_path / "deep.toml", node_1={"python": "/opt/edge/python"})
    out = run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path)
    deep = "corrupt JSON: lists or tables nested too deeply to read"
    assert_one_line(out, rf"error: node-1: refused: its device check: {deep}$")
    (row,) = json.loads(out.stdout)
    assert row["status"] == "refused" and row["reason"] == f"its device check: {deep}"

    async def data_report() -> None:
        async with Device(load_inventory(inv).targets[0]) as dev:
            await nodedata.report(dev, load_config().data, "unused")

    with pytest.raises(PipelineError, match=rf"^node-1: its data report: {deep}$"):
        asyncio.run(data_report())

    # JSON, but not the object a check prints.
    (device.disk / "deep.json").write_text("5")
    out = run_cli("cluster", "check", "--inventory", str(inv), "--json", cwd=tmp_path)
    assert_one_line(out, r"error: node-1: refused: its device check printed no JSON object$")


def folder_too_big_for(tmp_path: Path) -> Path:
    """The sample tiles and a 4 MB image (noise does not compress): more than a 1 MB disk holds."""
    folder = photos.sample_tiles(tmp_path / "photos")
    noise = np.random.default_rng(0).integers(0, 256, (1200, 1200, 3), dtype=np.uint8)
    Image.fromarray(noise).save(folder / "china" / "noise.png")
    return folder


def train_args(folder: Path, devices: str) -> tuple[str, ...]:
    """`pipeline train` options: send `folder` to the devices, which `devices` (train.devices) says how many need."""
    data = ("--set", f"data.path={json.dumps(str(folder))}", "--set", "data.sync=true")
    return (*data, "--set", f"train.devices={json.dumps(devices)}", *FAST)


@pytest.mark.slow  # a cluster run
def test_a_device_whose_disk_cannot_take_the_data_leaves_and_the_other_trains(
    jetson_fleet, forwarding, tmp_path: Path
) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    fleet["node-2"].resize_disk("1m")  # the code (~250 kB) fits, the data does not
    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inventory(fleet)), "--run-dir", str(run_dir),
                  *train_args(folder_too_big_for(tmp_path), "1:2"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[controller] node-2: cannot prepare its run directory: " in out.stderr
    summary = read_json(run_dir / layout.SUMMARY)
    assert summary["nodes"] == ["node-1"] and summary["world_size"] == 1
    assert summary["events"][0]["event"] == "left" and summary["events"][0]["node"] == "node-2"
    assert marked_processes(fleet) == []


@pytest.mark.slow  # the quick suite keeps to 10 minutes; its branch is one refusal after _prepare
def test_a_device_needed_whose_disk_cannot_take_the_data_is_one_line(jetson_fleet, forwarding, tmp_path: Path) -> None:
    fleet = start_cluster(jetson_fleet, 2)
    fleet["node-2"].resize_disk("1m")
    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inventory(fleet)), "--run-dir", str(run_dir),
                  *train_args(folder_too_big_for(tmp_path), "2"), cwd=tmp_path)  # fmt: skip
    assert_one_line(
        out,
        r"error: train: node-2: cannot prepare its run directory: SFTPFailure: Failure \(0\.\d MB free on the "
        r"device.s /opt/edge\); 1 devices remain, "
        r"below train.devices' minimum 2$",
    )
    assert not (run_dir / layout.SUMMARY).exists()
    assert marked_processes(fleet) == []


def linked_folder(tmp_path: Path) -> tuple[Path, Path]:
    """Sample tiles plus three links in china/: to an image outside the folder (bytes no other image has), to one
    beside it (relative), and to a directory named as an image. Returns the folder and the outside image."""
    folder = photos.sample_tiles(tmp_path / "photos")
    outside = tmp_path / "elsewhere"
    (outside / "album.png").mkdir(parents=True)
    image = outside / "outside.png"
    image.write_bytes((folder / "china" / "00.png").read_bytes() + b"\0" * 100)
    (folder / "china" / "linked.png").symlink_to(image)
    (folder / "china" / "relative.png").symlink_to("01.jpg")
    (folder / "china" / "album.png").symlink_to(outside / "album.png")
    return folder, image


@pytest.mark.slow  # a cluster run
def test_linked_images_are_sent_as_the_files_they_lead_to(jetson_fleet, forwarding, tmp_path: Path) -> None:
    """A file link is read through, wherever it leads, as a run on this machine reads it; the device gets the file
    (an SFTP upload of the link itself made a link there to a path it lacks: a checksum mismatch naming a hash)."""
    fleet = start_cluster(jetson_fleet, 1)
    folder, image = linked_folder(tmp_path)
    run_dir = tmp_path / "run"
    out = run_cli("train", "--inventory", str(inventory(fleet)), "--run-dir", str(run_dir),
                  *train_args(folder, "1"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tree = fleet["node-1"].disk / "train/data/sets" / read_json(run_dir / layout.SUMMARY)["data"]["id"]
    assert (tree / "china/linked.png").read_bytes() == image.read_bytes()
    assert (tree / "china/relative.png").read_bytes() == (folder / "china/01.jpg").read_bytes()
    assert not (tree / "china/album.png").exists()  # a directory, not an image
    assert not any(p.is_symlink() for p in tree.rglob("*"))


def test_a_link_that_leads_nowhere_is_one_line_naming_it(tmp_path: Path) -> None:
    """The fingerprint stat()ed it (a FileNotFoundError traceback) where the class listing skipped it in silence."""
    folder, _ = linked_folder(tmp_path)
    dangling = folder / "flower" / "gone.png"
    dangling.symlink_to(tmp_path / "deleted.png")
    expected = f"data.path: {dangling}: a symbolic link to {tmp_path / 'deleted.png'}, which does not exist"
    cfg = load_config(None, ["data.source=imagefolder", f"data.path={json.dumps(str(folder))}"]).data
    for read in (lambda: data.fingerprint(cfg), lambda: data.class_files(folder), lambda: data.check_source(cfg)):
        with pytest.raises(PipelineError, match=f"^{re.escape(expected)}$"):
            read()
    run_dir = tmp_path / "run"
    args = ("--set", "data.source=imagefolder", "--set", f"data.path={json.dumps(str(folder))}")
    assert_one_line(run_cli("train", "--run-dir", str(run_dir), *args, cwd=tmp_path), f"error: {re.escape(expected)}$")
