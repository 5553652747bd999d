"""Which TensorRT builder this host offers: the Python API, a `trtexec` executable, or none."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Literal

from pipeline.config import BuildConfig
from pipeline.errors import PipelineError

Builder = Literal["python", "trtexec"]


@dataclass(frozen=True)
class Choice:
    """The builder to use; `builder` is None when there is none, and `reason` says why."""

    builder: Builder | None
    trtexec: str | None = None
    """Resolved path of trtexec when `builder == "trtexec"`."""
    reason: str = ""


def tensorrt_import_error() -> str | None:
    """None when `import tensorrt` works, else the error in one line."""
    try:
        import tensorrt  # noqa: F401
    # A broken install fails with OSError (missing libnvinfer) or RuntimeError (CUDA), not only ImportError.
    except (ImportError, OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def cuda_present() -> bool:
    """Whether a CUDA GPU is usable from this process."""
    import torch

    return torch.cuda.is_available()


def python_api_problem() -> str | None:
    """None when the TensorRT Python API can build here, else why not."""
    error = tensorrt_import_error()
    if error is not None:
        return f"`import tensorrt` failed ({error})"
    if not cuda_present():
        return "`import tensorrt` works but no CUDA GPU is present"
    return None


def choose(cfg: BuildConfig) -> Choice:
    """Pick the builder `cfg.builder` asks for; a forced builder that is unavailable is a PipelineError."""
    if cfg.builder in ("auto", "python"):
        problem = python_api_problem()
        if problem is None:
            return Choice("python")
        if cfg.builder == "python":
            raise PipelineError(f"build.builder: 'python' needs the TensorRT Python API and a GPU: {problem}")
    exe = shutil.which(cfg.trtexec)
    if exe is not None:
        return Choice("trtexec", trtexec=exe)
    if cfg.builder == "trtexec":
        raise PipelineError(f"build.trtexec: {cfg.trtexec!r} is not an executable on PATH (build.builder = 'trtexec')")
    return Choice(None, reason=f"no TensorRT: {problem} and trtexec is not on PATH ({cfg.trtexec!r})")
