"""Facts about this machine: its GPU (compute capability, temperature) and whether TensorRT can build here.

nvidia-smi answers where torch cannot (a CPU-only torch build, a Jetson's own tools); every reading is optional and
"no reading" is never an error.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from pipeline.files import first_line

_DOTTED = re.compile(r"^(\d+)\.(\d+)$")


def nvidia_smi(field: str, timeout_s: float = 10.0) -> list[str]:
    """Values of `field` (e.g. "compute_cap", "temperature.gpu"), one per GPU; [] without nvidia-smi or on error."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def sm_tag(major: int, minor: int) -> str:
    """Compute capability 8.7 → "sm87"."""
    return f"sm{major}{minor}"


def nvidia_smi_sm() -> str | None:
    """The first GPU's compute capability as "smXY" according to nvidia-smi; None without a reading."""
    values = nvidia_smi("compute_cap", timeout_s=20)
    match = _DOTTED.match(values[0]) if values else None
    return sm_tag(int(match[1]), int(match[2])) if match else None


def cuda_present() -> bool:
    """Whether a CUDA GPU is usable from this process."""
    import torch

    return torch.cuda.is_available()


def local_sm() -> str | None:
    """This host's GPU compute capability as "smXY": from torch when CUDA works, else nvidia-smi, else None."""
    import torch

    if torch.cuda.is_available():
        return sm_tag(*torch.cuda.get_device_capability(0))
    return nvidia_smi_sm()


def tensorrt_import_error() -> str | None:
    """None when `import tensorrt` works, else the error in one line."""
    try:
        import tensorrt  # noqa: F401
    # A broken install fails with OSError (missing libnvinfer) or RuntimeError (CUDA), not only ImportError.
    except (ImportError, OSError, RuntimeError) as err:
        return first_line(err, typed=True)
    return None


def python_api_problem() -> str | None:
    """None when the TensorRT Python API can build here, else why not."""
    error = tensorrt_import_error()
    if error is not None:
        return f"`import tensorrt` failed ({error})"
    if not cuda_present():
        return "`import tensorrt` works but no CUDA GPU is present"
    return None
