"""The dataset of a cluster job: sent once from the controller (`data.sync`), or read where it already is.

Sent (`data.sync = true`): the controller's `data.path` goes to every device with the fleet's verified,
deduplicating, resumable upload (:mod:`pipeline.fleet.upload`). The upload takes flat file names, so the images
travel content-addressed, each named by its sha256, with `INDEX.json` (relative path → sha256); the bundle's id is
the index's digest, so an unchanged folder is a bundle the device already holds whole and sends nothing, and a
changed one sends only images no earlier version had. The device then rebuilds the folder tree from hard links
(`<root>/train/data/sets/<id>`, renamed into place only when whole) and the ranks read it there
(`PIPELINE_DATA_PATH`, :func:`pipeline.train.rank.runtime.data_config`); the config keeps the controller's path, so the
run's config, checkpoints and fingerprint are those of the data as the controller has it.

Where it is (`data.sync = false`): each device reads `data.path` on its own disk. The controller asks every device
for its folder's fingerprint, class names and image count before anything starts; devices whose class names differ
are refused (the model's head would mean different things on each), and the run's data fingerprint is the digest of
every device's.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline import data
from pipeline.config import Config, DataConfig
from pipeline.errors import PipelineError
from pipeline.files import parse_json
from pipeline.fleet import upload
from pipeline.fleet.inventory import SshTarget
from pipeline.fleet.ssh import Device

INDEX = "INDEX.json"
FINGERPRINT_TIMEOUT_S = 300

_REPORT = """
import json, sys
from pipeline import data
from pipeline.config import DataConfig
from pipeline.errors import PipelineError
cfg = DataConfig.model_validate_json(sys.stdin.read())
try:
    data.check_source(cfg)
    classes, items = data.class_files(cfg.path)
    found = {"fingerprint": data.fingerprint(cfg), "classes": classes, "images": len(items)}
except PipelineError as err:
    found = {"error": str(err)}
print("NODEDATA " + json.dumps(found))
"""


def node_local(cfg: Config) -> bool:
    """True when each device reads its own `data.path` (a cluster job on an ImageFolder that is not sent)."""
    return cfg.train.inventory is not None and cfg.data.source == "imagefolder" and not cfg.data.sync


def sent(cfg: Config) -> bool:
    """True when the controller sends its `data.path` to every device."""
    return cfg.train.inventory is not None and cfg.data.source == "imagefolder" and cfg.data.sync


# --- sent: the folder as one content-addressed bundle --------------------------------------------------------------


def dataset_bundle(cfg: DataConfig, workdir: Path) -> upload.Bundle:
    """The controller's image folder as a bundle: files named by sha256, plus INDEX.json that places them."""
    data.check_source(cfg)
    assert cfg.path is not None  # imagefolder
    _, items = data.class_files(cfg.path)
    index: dict[str, str] = {}
    files: dict[str, Path] = {}
    for path, _ in items:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        index[path.relative_to(cfg.path).as_posix()] = digest
        # The link's file, not the link: an SFTP upload copies a symbolic link as a link, to a path the device lacks.
        files.setdefault(digest, path.resolve())
    text = json.dumps(index, sort_keys=True, indent=0)
    bundle_id = "data-" + hashlib.sha256(text.encode()).hexdigest()[:20]
    (workdir / INDEX).write_text(text)
    # Each image was hashed once above (its name is its sha256); upload.bundle would read them all again.
    sums = {name: name for name in files} | {INDEX: hashlib.sha256(text.encode()).hexdigest()}
    files[INDEX] = workdir / INDEX
    return upload.Bundle(bundle_id, files, sums)


def files_dir(target: SshTarget) -> str:
    """Where dataset bundles (flat, content-addressed) live on the device."""
    return f"{target.root}/train/data/files"


def tree_dir(target: SshTarget, bundle_id: str) -> str:
    """Where the folder the ranks read is rebuilt on the device."""
    return f"{target.root}/train/data/sets/{bundle_id}"


def tree_script(target: SshTarget, item: upload.Bundle) -> str:
    """Shell that rebuilds the folder from hard links into the bundle (renamed into place when whole), then drops
    every other dataset version from the device."""
    index: dict[str, str] = json.loads(item.files[INDEX].read_text())
    q = shlex.quote
    tree, src = tree_dir(target, item.id), f"{files_dir(target)}/{item.id}"
    lines = ["set -e", f"if [ ! -d {q(tree)} ]; then", f"rm -rf {q(tree)}.part", f"mkdir -p {q(tree)}.part"]
    lines += [f"mkdir -p {q(f'{tree}.part/{d}')}" for d in sorted({rel.rpartition("/")[0] for rel in index})]
    lines += [
        f"ln -f {q(f'{src}/{digest}')} {q(f'{tree}.part/{rel}')} || cp {q(f'{src}/{digest}')} {q(f'{tree}.part/{rel}')}"
        for rel, digest in sorted(index.items())
    ]
    lines += [f"mv {q(tree)}.part {q(tree)}", "fi"]
    # Earlier versions went on serving deduplication during the upload; now only this one is needed.
    for parent in (files_dir(target), f"{target.root}/train/data/sets"):
        lines.append(f'for d in {q(parent)}/*; do [ "${{d##*/}}" = {q(item.id)} ] || rm -rf "$d"; done')
    return "\n".join(lines) + "\n"


async def send(dev: Device, item: upload.Bundle, workdir: Path) -> int:
    """Make the dataset whole on the device; returns the bytes sent (0 when it already held this version)."""
    target = dev.target
    cost = await upload.send(dev, files_dir(target), item, workdir)
    out = await dev.run("sh -s", timeout_s=FINGERPRINT_TIMEOUT_S, stdin=tree_script(target, item))
    if not out.ok:
        raise PipelineError(f"{target.name}: cannot place the dataset at {tree_dir(target, item.id)}: {out.tail()}")
    return cost.bytes


# --- where it is: every device's folder, fingerprinted there -------------------------------------------------------


@dataclass
class NodeData:
    """One device's own dataset, as it reported it."""

    fingerprint: str
    classes: list[str]
    images: int


async def report(dev: Device, cfg: DataConfig, python_path: str) -> NodeData:
    """Fingerprint, classes and image count of `data.path` on the device (its Python, the shipped code)."""
    target = dev.target
    command = f"PYTHONPATH={shlex.quote(python_path)} {target.python} -c {shlex.quote(_REPORT)}"
    out = await dev.run(command, FINGERPRINT_TIMEOUT_S, stdin=cfg.model_dump_json())
    lines = [line for line in out.stdout.splitlines() if line.startswith("NODEDATA ")]
    if not lines:
        raise PipelineError(f"{target.name}: cannot read its data.path: {out.tail()}")
    found: dict[str, Any] = parse_json(lines[-1].removeprefix("NODEDATA "), f"{target.name}: its data report")
    if "error" in found:
        raise PipelineError(f"{target.name}: {found['error']}")
    return NodeData(**found)


def check_classes(nodes: dict[str, NodeData]) -> dict[str, NodeData]:
    """`nodes`, unless two devices' folders name different classes (one line naming the device)."""
    first_name, first = next(iter(nodes.items()))
    for name, node in nodes.items():
        if node.classes != first.classes:
            raise PipelineError(
                f"{name}: data.path has classes {', '.join(node.classes)}; {first_name} has "
                f"{', '.join(first.classes)}: every device needs the same class folders"
            )
    return nodes


def combined(nodes: dict[str, NodeData]) -> str:
    """The run's data fingerprint: one digest over every device's, by device name."""
    text = json.dumps({name: node.fingerprint for name, node in sorted(nodes.items())})
    return hashlib.sha256(text.encode()).hexdigest()


def record(nodes: dict[str, NodeData]) -> dict[str, Any]:
    """What summary.json says about node-local data."""
    return {"mode": "node", "fingerprint": combined(nodes), "nodes": {n: asdict(d) for n, d in sorted(nodes.items())}}
