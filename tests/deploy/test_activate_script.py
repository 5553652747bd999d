"""activate.sh on its own, under dash and under BusyBox (only BusyBox applets on PATH), without SSH."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.deploy.hosts import LocalSpot
from pipeline.deploy.release import sums_text
from pipeline.deploy.remote import ACTIVATE_NAMES, activate_command, parse_activation
from pipeline.deploy.stage import ACTIVATE_SCRIPT
from pipeline.layout import ACTIVATE


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


def make_release(root: Path, rid: str, names: dict[str, str] = ACTIVATE_NAMES) -> None:
    """Release `rid` as an upload leaves it, under the deploy root's `names` (activate.sh's environment)."""
    release = root / names["RELEASES_DIR"] / rid
    release.mkdir(parents=True)
    files = {names["ONNX_FILE"]: rid.encode() * 10, "labels.txt": b"a\n"}
    for name, data in files.items():
        (release / name).write_bytes(data)
    (release / names["SUMS_FILE"]).write_text(sums_text({n: hashlib.sha256(d).hexdigest() for n, d in files.items()}))
    shutil.copy(ACTIVATE_SCRIPT, release / ACTIVATE)


def activate(
    shell: tuple[list[str], dict[str, str]],
    root: Path,
    rid: str,
    health: str = "",
    keep: int = 2,
    names: dict[str, str] = ACTIVATE_NAMES,
) -> dict:
    """Install release `rid` (as the controller would have) and run its activate.sh with the deploy root's `names` in
    its environment, as the controller runs it; returns the parsed report."""
    if not (root / names["RELEASES_DIR"] / rid).exists():
        make_release(root, rid, names)
    argv, env = shell
    script = root / names["RELEASES_DIR"] / rid / ACTIVATE
    out = subprocess.run(
        [*argv, str(script), str(root), rid, str(keep), "", health],
        capture_output=True,
        text=True,
        env={**env, **names},
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


def test_the_deploy_roots_names_come_from_the_controller():
    """The command the controller runs hands activate.sh every name it works with (from layout and upload), and the
    script spells none of them itself (its comments and the report's `ACTIVATE key=` words aside)."""
    spot = LocalSpot(name="here", root="/srv/edge", health_command="true")
    command = shlex.split(activate_command(spot, "r1", 3))
    assert command[: len(ACTIVATE_NAMES)] == [f"{var}={name}" for var, name in ACTIVATE_NAMES.items()]
    assert command[len(ACTIVATE_NAMES) :] == [
        "sh",
        "/srv/edge/releases/r1/activate.sh",
        "/srv/edge",
        "r1",
        "3",
        "",
        "true",
    ]

    script = ACTIVATE_SCRIPT.read_text()
    required = re.search(r"^for name in (.*); do$", script, re.MULTILINE)
    assert required is not None and required[1].split() == list(ACTIVATE_NAMES)
    code = "\n".join(re.sub(r"(^|\s)#\s.*", "", line) for line in script.splitlines())
    code = re.sub(r"ACTIVATE \w+=", "", code)
    for name in ACTIVATE_NAMES.values():
        assert re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", code) is None, f"activate.sh spells {name!r}"


def test_activate_works_on_whatever_names_it_is_handed(tmp_path: Path):
    """Renamed in its environment, every name is used as given: the links, the releases' directory, the checksums
    file and the model it preflights, the staging suffix it prunes."""
    shell = shell_env("dash", tmp_path)
    root = tmp_path / "edge"
    names = {
        "RELEASES_DIR": "versions",
        "CURRENT_LINK": "live",
        "PREVIOUS_LINK": "before",
        "PART_SUFFIX": ".incoming",
        "SUMS_FILE": "CHECKSUMS",
        "PLAN_FILE": "engine.bin",
        "ONNX_FILE": "net.onnx",
        "SAMPLE_FILE": "probe.npz",
    }
    assert set(names) == set(ACTIVATE_NAMES)
    assert activate(shell, root, "r1", names=names)["status"] == "ACTIVE"
    (root / "versions/r9.incoming").mkdir()  # an interrupted upload of another release
    assert activate(shell, root, "r2", names=names) == {
        "status": "ACTIVE",
        "current": "r2",
        "previous": "r1",
        "reason": "",
    }
    assert (os.readlink(root / "live"), os.readlink(root / "before")) == ("versions/r2", "versions/r1")
    assert sorted(os.listdir(root / "versions")) == ["r1", "r2"]

    make_release(root, "r3", names)
    (root / "versions/r3/net.onnx").write_bytes(b"bit rot")
    failed = activate(shell, root, "r3", names=names)
    assert (failed["status"], failed["reason"]) == ("PREFLIGHT_FAILED", "preflight: files do not match CHECKSUMS")


def test_activate_without_the_names_fails_before_touching_anything(tmp_path: Path):
    """Run without the controller's environment (by hand, or by a controller that predates it), it reports FAILED
    and leaves the deploy root as it was."""
    root = tmp_path / "edge"
    make_release(root, "r1")
    missing = {var: name for var, name in ACTIVATE_NAMES.items() if var != "CURRENT_LINK"}
    script = root / "releases/r1" / ACTIVATE
    out = subprocess.run(
        ["dash", str(script), str(root), "r1", "2", "", ""],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **missing},
    )
    assert out.returncode == 1
    assert parse_activation(out.stdout) == {
        "status": "FAILED",
        "reason": "CURRENT_LINK is not set (the controller sets it)",
    }
    assert sorted(os.listdir(root)) == ["releases"]
