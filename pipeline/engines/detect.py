"""Which TensorRT builder this host offers: the Python API, a `trtexec` executable, or none."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Literal

from pipeline.config import BuildConfig
from pipeline.errors import PipelineError
from pipeline.host import python_api_problem

Builder = Literal["python", "trtexec"]


@dataclass(frozen=True)
class Choice:
    """The builder to use; `builder` is None when there is none, and `reason` says why."""

    builder: Builder | None
    trtexec: str | None = None
    """Resolved path of trtexec when `builder == "trtexec"`."""
    reason: str = ""


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
