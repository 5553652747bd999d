"""activate.sh on its own, under dash and under BusyBox (only BusyBox applets on PATH), without SSH."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.deploy.release import sums_text
from pipeline.deploy.remote import parse_activation
from pipeline.deploy.stage import ACTIVATE_SCRIPT


def shell_env(kind: str, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment for a shell: dash with the system PATH, or BusyBox with only its applets."""
    if kind == "dash":
        if shutil.which("dash") is None:
            pytest.skip("dash not installed")
        return ["dash"], {"PATH": "/usr/bin:/bin"}
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox not installed (apt-get install busybox)")
    bin_dir = tmp_path / "busybox-bin"
    bin_dir.mkdir()
    for applet in subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
        os.symlink(busybox, bin_dir / applet)
    return [busybox, "sh"], {"PATH": str(bin_dir)}


def make_release(root: Path, rid: str) -> None:
    release = root / "releases" / rid
    release.mkdir(parents=True)
    files = {"model.onnx": rid.encode() * 10, "labels.txt": b"a\n"}
    for name, data in files.items():
        (release / name).write_bytes(data)
    (release / "SHA256SUMS").write_text(sums_text({n: hashlib.sha256(d).hexdigest() for n, d in files.items()}))
    shutil.copy(ACTIVATE_SCRIPT, release / "activate.sh")


def activate(shell: tuple[list[str], dict[str, str]], root: Path, rid: str, health: str = "", keep: int = 2) -> dict:
    """Install release `rid` (as the controller would have) and run its activate.sh; returns the parsed report."""
    if not (root / "releases" / rid).exists():
        make_release(root, rid)
    argv, env = shell
    script = root / "releases" / rid / "activate.sh"
    out = subprocess.run(
        [*argv, str(script), str(root), rid, str(keep), "", health], capture_output=True, text=True, env=env
    )
    report = parse_activation(out.stdout)
    assert (out.returncode == 0) == (report.get("status") == "ACTIVE"), out.stdout + out.stderr
    return report


@pytest.mark.parametrize("kind", ["dash", "busybox"])
def test_switch_rollback_and_prune_in_a_minimal_shell(kind: str, tmp_path: Path):
    shell = shell_env(kind, tmp_path)
    root = tmp_path / "edge"

    assert activate(shell, root, "r1") == {"status": "ACTIVE", "current": "r1", "previous": "", "reason": ""}
    assert activate(shell, root, "r2")["previous"] == "r1"
    assert os.readlink(root / "current") == "releases/r2" and os.readlink(root / "previous") == "releases/r1"

    # A health command that fails after the switch: both links go back, the bad release is removed. Its last
    # `HEALTH <json>` line (from the check after the switch) comes back with the report.
    verdict = 'echo "HEALTH {\\"dir\\": \\"${RELEASE_DIR##*/}\\"}"'
    sick = f'{verdict}; test "$RELEASE_DIR" != "$PWD/current" || {{ echo sick; exit 1; }}'
    failing = activate(shell, root, "r3", health=sick)
    assert failing["status"] == "ROLLED_BACK" and failing["reason"] == "after switch: sick; back to r2"
    assert failing["health"] == '{"dir": "current"}'
    assert (os.readlink(root / "current"), os.readlink(root / "previous")) == ("releases/r2", "releases/r1")
    assert not (root / "releases/r3").exists()

    # Preflight (no engine, no health command, no onnxruntime): the checksums. No health comes back this time.
    make_release(root, "r4")
    (root / "releases/r4/model.onnx").write_bytes(b"bit rot")
    assert activate(shell, root, "r4") | {"reason": ""} == {
        "status": "PREFLIGHT_FAILED",
        "current": "r2",
        "previous": "r1",
        "reason": "",
    }
    assert not (root / "releases/r4").exists()

    for rid in ("r5", "r6"):
        assert activate(shell, root, rid, keep=2)["status"] == "ACTIVE"
    # keep = 2 newest (r6, r5); r2 went (older, neither current nor previous), r1 went too.
    assert sorted(os.listdir(root / "releases")) == ["r5", "r6"]
    assert not list(root.glob(".current.new"))


def test_prune_keeps_the_newest_activations_and_never_previous(tmp_path: Path):
    shell = shell_env("dash", tmp_path)
    root = tmp_path / "edge"
    for order, rid in enumerate(["r1", "r2", "r3", "r4", "r5"], start=1):
        make_release(root, rid)
        (root / "releases" / rid / ".order").write_text(f"{order}\n")
    (root / ".seq").write_text("5\n")
    (root / "releases/r9.part").mkdir()  # an interrupted upload of another release
    os.symlink("releases/r1", root / "current")
    os.symlink("releases/r2", root / "previous")

    # r1 again: now the newest activation. Of the rest only r5 is among the newest two, but `previous` is r2.
    assert activate(shell, root, "r1", keep=2)["status"] == "ACTIVE"
    assert sorted(os.listdir(root / "releases")) == ["r1", "r2", "r5"]
    assert (root / "releases/r1/.order").read_text() == "6\n"


def test_a_reader_always_finds_a_whole_release_during_switches(tmp_path: Path):
    """A reader polling `current` during 100 activations always finds a link to a complete release (with `rm` +
    `ln -s` instead of the rename, 60 activations were enough to catch it missing)."""
    shell = shell_env("dash", tmp_path)
    root = tmp_path / "edge"
    activate(shell, root, "r1")
    make_release(root, "r2")
    # The reader is its own process: a thread would hold the GIL against the activations it watches.
    poll = "while [ ! -e stop ]; do cat current/model.onnx >/dev/null || echo MISSED; done"
    reader = subprocess.Popen(["dash", "-c", poll], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for i in range(100):
        activate(shell, root, "r2" if i % 2 == 0 else "r1")
    (root / "stop").touch()
    assert reader.communicate(timeout=30)[0] == b""
    assert (os.readlink(root / "current"), os.readlink(root / "previous")) == ("releases/r1", "releases/r2")
    assert not list(root.glob(".current.new"))
