"""The CLI on bad input: one line on stderr, exit code 2, no traceback, nothing overwritten."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.manifest import create_run_dir


def pipeline(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Wide enough that rich tables are not cut; every warning enabled, which must not add a line to any error.
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True, env=env)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture
def existing_run(tmp_path: Path) -> Path:
    """A run directory with a manifest and config snapshot whose bytes the tests check are untouched."""
    run = tmp_path / "run"
    create_run_dir(load_config(), run)
    return run


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_malformed_toml(tmp_path: Path, existing_run: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nepochs = = 3\n")
    before = _snapshot(existing_run)
    _assert_one_line_error(
        pipeline("run", "--config", str(bad), "--run-dir", str(existing_run), cwd=tmp_path), "bad.toml"
    )
    assert _snapshot(existing_run) == before


def test_unknown_key_names_its_dotted_path(tmp_path: Path, existing_run: Path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nepochs = 3\nlearning_rate = 0.1\n")
    before = _snapshot(existing_run)
    proc = pipeline("run", "--config", str(cfg), "--run-dir", str(existing_run), cwd=tmp_path)
    _assert_one_line_error(proc, "train.learning_rate: unknown key")
    assert _snapshot(existing_run) == before


def test_unknown_key_in_set(tmp_path: Path, existing_run: Path):
    before = _snapshot(existing_run)
    proc = pipeline("export", "--run-dir", str(existing_run), "--set", "export.tolerance=1", cwd=tmp_path)
    _assert_one_line_error(proc, "export.tolerance: unknown key")
    assert _snapshot(existing_run) == before


RENAMED_NNODES = (
    'train.nnodes: renamed to train.devices (how many inventory devices the SSH job needs, "N" or "MIN:MAX"; '
    "the CLI's --nnodes is torchrun's node count)"
)


def test_renamed_key_in_set_names_the_new_key(tmp_path: Path):
    proc = pipeline("run", "--set", "train.nnodes=2", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    _assert_one_line_error(proc, RENAMED_NNODES)
    assert not (tmp_path / "run").exists()


def test_renamed_key_in_toml_names_the_new_key(tmp_path: Path, existing_run: Path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nepochs = 3\nnnodes = "2:3"\n')
    before = _snapshot(existing_run)
    proc = pipeline("run", "--config", str(cfg), "--run-dir", str(existing_run), cwd=tmp_path)
    _assert_one_line_error(proc, f"c.toml: {RENAMED_NNODES}")
    assert _snapshot(existing_run) == before


def test_devices_out_of_pattern_is_one_line(tmp_path: Path):
    proc = pipeline("run", "--set", 'train.devices="0"', "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    _assert_one_line_error(proc, "train.devices: String should match pattern")
    assert not (tmp_path / "run").exists()


def test_missing_config_file(tmp_path: Path):
    proc = pipeline("run", "--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    _assert_one_line_error(proc, "nope.toml: config file not found")
    assert not (tmp_path / "artifacts").exists()


def test_stage_on_a_directory_that_is_not_a_run(tmp_path: Path):
    _assert_one_line_error(pipeline("consolidate", "--run-dir", str(tmp_path), cwd=tmp_path), "no config.json")


def test_stage_with_missing_inputs(tmp_path: Path, existing_run: Path):
    proc = pipeline("export", "--run-dir", str(existing_run), cwd=tmp_path)
    _assert_one_line_error(proc, "model/model.safetensors (run the earlier stages first)")


def test_runs_list_and_show(tmp_path: Path):
    from pipeline.manifest import StageResult

    for run_id, accuracy, deployed in (("20260101-000000-aaaa", 0.91, True), ("20260102-000000-bbbb", 0.97, False)):
        run = create_run_dir(load_config(), tmp_path / run_id)
        run.record(StageResult("train", "done", metrics={"val_accuracy": accuracy}), {})
        if deployed:
            run.record(StageResult("deploy", "done"), {})
    listing = pipeline("runs", "list", "--root", str(tmp_path), cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    champion_line = next(line for line in listing.stdout.splitlines() if "20260101" in line)
    assert "0.9100" in champion_line and "deployed (champion)" in champion_line
    assert listing.stdout.index("20260102") < listing.stdout.index("20260101")  # newest first
    shown = pipeline("runs", "show", str(tmp_path / "20260102-000000-bbbb"), cwd=tmp_path)
    assert shown.returncode == 0 and "val accuracy 0.9700" in shown.stdout
    _assert_one_line_error(pipeline("runs", "show", str(tmp_path), cwd=tmp_path), "not a run directory")


def test_deeply_nested_input_is_one_line_and_runs_list_skips_it(tmp_path: Path):
    """Nesting past Python's recursion limit, in a --set value or a run's manifest: one line, never a traceback."""
    deep = "[" * 5000 + "]" * 5000
    _assert_one_line_error(
        pipeline("train", "--run-dir", str(tmp_path / "r"), "--set", f"train.lr={deep}", cwd=tmp_path),
        "--set train.lr: lists or tables nested too deeply to read",
    )
    assert not (tmp_path / "r").exists()
    create_run_dir(load_config(), tmp_path / "20260101-000000-good")
    bad = tmp_path / "20260102-000000-deep"
    bad.mkdir()
    (bad / "manifest.json").write_text(f'{{"run_id": "x", "stages": {{}}, "stopped": {deep}}}')
    listing = pipeline("runs", "list", "--root", str(tmp_path), cwd=tmp_path)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert "20260101-000000-good" in listing.stdout and "20260102" not in listing.stdout
    note = f"skipping run {bad.name}: {bad}/manifest.json: corrupt JSON: lists or tables nested too deeply to read"
    assert listing.stderr.strip() == note
    _assert_one_line_error(pipeline("runs", "show", str(bad), cwd=tmp_path), "nested too deeply to read")


READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize("command", [["consolidate"], ["run", "--set", "train.epochs=1"]])
def test_read_only_run_directory_is_one_line(tmp_path: Path, existing_run: Path, command: list[str]):
    """The run directory on a read-only mount (in a mount namespace of its own): one line naming it, exit 2."""
    before = _snapshot(existing_run)
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "default"}
    cmd = [sys.executable, "-m", "pipeline", *command, "--run-dir", str(existing_run)]
    wrapped = ["unshare", "--mount", "sh", "-c", READ_ONLY, "sh", str(existing_run), *cmd]
    proc = subprocess.run(wrapped, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    _assert_one_line_error(proc, f"{existing_run}")
    assert "Read-only file system" in proc.stderr
    assert _snapshot(existing_run) == before


def test_commands_that_run_no_stage_import_no_stage_library(tmp_path: Path):
    # torch, onnxruntime and sklearn cost seconds to import: `pipeline --help`, a bad config and `runs list` answer
    # in well under a second because the stages are imported only when one runs (pipeline/stages.py, stage_named).
    probe = (
        "import sys\nfrom pipeline.cli import app\n"
        "try:\n    app(['runs', 'list', '--root', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'onnxruntime', 'sklearn', 'prefect'} & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
