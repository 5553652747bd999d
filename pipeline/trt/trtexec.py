"""NVIDIA's `trtexec`: its version banner, its error lines, and running it in its own process group under a timeout."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.host import sm_tag

# Every trtexec run starts with `&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec ...`: the packed
# NV_TENSORRT_VERSION, major*10000 + minor*100 + patch since 10.0 and major*1000 + minor*100 + patch before
# (docs/tensorrt.md#reading-the-version-from-the-banner).
_BANNER = re.compile(r"\[TensorRT v(\d{4,6})\]")
_COMPUTE_CAPABILITY = re.compile(r"Compute Capability:\s*(\d+)\.(\d+)")
# TensorRT's own errors ("Error[4]: ...", "ERROR: ...") say what went wrong; trailing "[E] Engine set up
# failed" lines only say that it did.
_SPECIFIC_ERROR = re.compile(r"\bError\[\d+\]|\bERROR:")
_ANY_ERROR = re.compile(r"\[E\]|\bERROR\b")
PROBE_TIMEOUT_S = 60


def decode_version(packed: str) -> str:
    """ "100300" → "10.3.0", "8601" → "8.6.1"."""
    number = int(packed)
    major, rest = divmod(number, 10000 if number >= 100000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def parse_version(output: str) -> str | None:
    """TensorRT version from trtexec's banner, None when there is no banner."""
    match = _BANNER.search(output)
    return decode_version(match[1]) if match else None


def parse_sm(output: str) -> str | None:
    """GPU compute capability from trtexec's device information ("Compute Capability: 8.7" → "sm87")."""
    match = _COMPUTE_CAPABILITY.search(output)
    return sm_tag(int(match[1]), int(match[2])) if match else None


def last_error(output: str) -> str:
    """The line a user needs first: the last specific error, else the last error line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    specific = [line for line in lines if _SPECIFIC_ERROR.search(line)]
    generic = [line for line in lines if _ANY_ERROR.search(line)]
    return (specific or generic or lines or ["(no output)"])[-1]


def run_logged(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int, str]:
    """Run `cmd` in a new session with stdout+stderr to `log_path`; kill its whole group on timeout or cancel."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise PipelineError(f"build.timeout_s: {cmd[0]} did not finish within {timeout_s}s (killed)") from None
        except BaseException:
            _kill_group(proc)
            raise
    return returncode, log_path.read_text(errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def probe_version(exe: str, scratch: Path) -> str | None:
    """TensorRT version of `exe` from the banner of `trtexec --version` (printed even by versions without it)."""
    try:
        _, output = run_logged([exe, "--version"], scratch / "trtexec-version.log", PROBE_TIMEOUT_S)
    except (OSError, PipelineError):
        return None
    return parse_version(output)
