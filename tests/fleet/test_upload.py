"""The verified upload with more files than one shell command line can name (Linux caps one argument, the whole
`sh -c` command, at 128 KiB): a dataset of a few thousand images is sent, checked and then reused whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeline.deploy.hosts import LocalHost, LocalSpot
from pipeline.fleet import upload

FILES = 3000
"""With 40-character names, 120 KB of names: over 128 KiB as soon as a command names them more than once."""


def many_files(folder: Path) -> dict[str, Path]:
    folder.mkdir()
    files = {}
    for i in range(FILES):
        name = f"image-{i:05d}-{'x' * 24}.png"
        (folder / name).write_bytes(i.to_bytes(2, "big"))
        files[name] = folder / name
    return files


def test_thousands_of_files_are_sent_verified_and_then_reused(tmp_path: Path) -> None:
    files = many_files(tmp_path / "local")
    device = tmp_path / "device"
    device.mkdir()
    host = LocalHost(LocalSpot(name="here", root=str(device), health_command=""))
    work = tmp_path / "work"
    work.mkdir()

    first = asyncio.run(upload.send(host, str(device), upload.bundle("data-1", files), work))
    assert (first.files, first.reused) == (FILES + 1, 0)  # every file and SHA256SUMS
    assert sorted(p.name for p in (device / "data-1").iterdir()) == sorted([*files, upload.SUMS])

    # Another bundle of the same files: every one (SHA256SUMS too) linked from data-1, none sent; a stray file in
    # .part is removed.
    (device / "data-2.part").mkdir()
    (device / "data-2.part/stray.tmp").write_text("left by a cut upload")
    second = asyncio.run(upload.send(host, str(device), upload.bundle("data-2", files), work))
    assert (second.bytes, second.files, second.reused) == (0, 0, FILES + 1)
    assert sorted(p.name for p in (device / "data-2").iterdir()) == sorted([*files, upload.SUMS])
    assert (device / "data-2" / "image-02999-xxxxxxxxxxxxxxxxxxxxxxxx.png").read_bytes() == (2999).to_bytes(2, "big")
