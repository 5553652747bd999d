"""trtexec plumbing: its banner, its error lines, and a timeout that kills the whole process group."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.trt import trtexec
from tests.engines.standins import StandinTrtexec


@pytest.mark.parametrize(
    ("line", "version"),
    [
        ("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # /usr/src/tensorrt/bin/trtexec --version", "10.3.0"),
        ("&&&& PASSED TensorRT.trtexec [TensorRT v100800] [b43] # trtexec --onnx=m.onnx", "10.8.0"),
        ("&&&& RUNNING TensorRT.trtexec [TensorRT v8502] # trtexec", "8.5.2"),
        ("&&&& RUNNING TensorRT.trtexec [TensorRT v8601] # trtexec", "8.6.1"),
        ("&&&& RUNNING TensorRT.trtexec [TensorRT v110000] # trtexec", "11.0.0"),
        ("trtexec: command not found", None),
    ],
)
def test_version_from_banner(line: str, version: str | None):
    assert trtexec.parse_version(f"[I] noise\n{line}\n[I] more noise") == version


def test_last_error_prefers_the_specific_line():
    output = "\n".join(
        [
            "[I] Compute Capability: 8.7",
            "[E] Error[4]: [network.cpp::validate::3162] Error Code 4: bad profile",
            "[E] Engine could not be created from network",
            "[E] Engine set up failed",
            "&&&& FAILED TensorRT.trtexec [TensorRT v100300] # trtexec",
        ]
    )
    assert trtexec.last_error(output).startswith("[E] Error[4]: [network.cpp::validate::3162]")
    assert trtexec.last_error("[I] ok\n[E] Engine set up failed\n&&&& FAILED x") == "[E] Engine set up failed"
    assert trtexec.last_error("segfault\n\n") == "segfault"
    assert trtexec.parse_sm("[I] Compute Capability: 8.7\n") == "sm87"


def _alive(pid: int) -> bool:
    """Running and not a zombie (nothing may reap orphans inside a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_timeout_kills_the_whole_process_group(fake_trtexec: Callable[..., Path], tmp_path: Path):
    exe = fake_trtexec(mode="hang")
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"build\.timeout_s: .* did not finish within 1\.5s"):
        trtexec.run_logged([str(exe), "--onnx=x"], tmp_path / "out.log", timeout_s=1.5)
    assert time.monotonic() - started < 10
    child = int(Path(f"{exe}.calls.child").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "trtexec's child survived the timeout"
    assert "Compute Capability" in (tmp_path / "out.log").read_text()


def test_probe_reads_the_banner_of_version(fake_trtexec: Callable[..., Path], tmp_path: Path):
    assert trtexec.probe_version(str(fake_trtexec(packed="8601")), tmp_path) == "8.6.1"
    assert trtexec.probe_version(str(tmp_path / "missing"), tmp_path) is None


@pytest.mark.parametrize(
    ("version", "option", "error"),
    [
        ("8.5.2", "--skipInference", "Unknown option: --skipInference"),
        ("8.6.2", "--getPlanVersionOnly", "Unknown option: --getPlanVersionOnly"),
        ("10.0.0", "--buildOnly", "Unknown option: --buildOnly"),
        ("10.3.0", "--workspace=512", "Unknown option: --workspace"),
        ("11.0.0", "--fp16", "Unknown option: --fp16"),
        ("10.0.1", "--memPoolSize=workspace:1024M", "TensorRT 10.0.1 misreads a unit suffix"),
        ("11.2.0", "--useDLACore=0", "Cannot create DLA engine, 0 not available"),
    ],
)
def test_the_standin_refuses_what_its_version_lacks(
    standin: Callable[..., StandinTrtexec], tmp_path: Path, version: str, option: str, error: str
):
    """The stand-in follows docs/tensorrt.md's option matrix, so a build passing an option its version lacks fails."""
    tool = standin(version)
    out = subprocess.run([str(tool.exe), f"--onnx={tmp_path / 'm.onnx'}", option], capture_output=True, text=True)
    assert out.returncode == 1 and error in out.stdout
