"""Device classes: an engine is valid for one (GPU compute capability, TensorRT version) pair."""

from __future__ import annotations

import re

from pipeline import nvidia_smi

_DOTTED = re.compile(r"^(\d+)\.(\d+)$")


def sm_tag(major: int, minor: int) -> str:
    """Compute capability 8.7 → "sm87"."""
    return f"sm{major}{minor}"


def device_class(sm: str | None, trt_version: str | None) -> str:
    """`local-<sm>-trt<version>` when both are known, else plain "local" (an engine of unknown provenance)."""
    if sm and trt_version:
        return f"local-{sm}-trt{trt_version}"
    return "local"


def _nvidia_smi_sm() -> str | None:
    values = nvidia_smi.query("compute_cap", timeout_s=20)
    match = _DOTTED.match(values[0]) if values else None
    return sm_tag(int(match[1]), int(match[2])) if match else None


def local_sm() -> str | None:
    """This host's GPU compute capability as "smXY": from torch when CUDA works, else nvidia-smi, else None."""
    import torch

    if torch.cuda.is_available():
        return sm_tag(*torch.cuda.get_device_capability(0))
    return _nvidia_smi_sm()
