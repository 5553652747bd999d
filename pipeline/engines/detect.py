"""This host as a device class: which TensorRT builder it offers (the Python API, a `trtexec` executable, or none),
that builder's TensorRT version and the GPU, and the class they name (`local-<sm>-trt<version>`)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.config import BuildClass, BuildConfig
from pipeline.engines import python_api
from pipeline.errors import PipelineError
from pipeline.fleet.classes import DeviceClass, host_class
from pipeline.host import local_sm, python_api_problem
from pipeline.trt import trtexec

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


@dataclass(frozen=True)
class Host:
    """The chosen builder and what is known about this host before building."""

    choice: Choice
    tensorrt_version: str | None = None
    sm: str | None = None

    def fingerprint(self) -> str:
        """Part of the stage's cache key: a new TensorRT or GPU makes the cached engine stale."""
        return f"{self.choice.builder} {self.tensorrt_version or '?'} {self.sm or '?'}"

    def as_class(self, engines: Path) -> BuildClass:
        """This host's class as far as it is known before building (`local` while the GPU or TensorRT version is
        unknown: the build then names it). trtexec reports the GPU only while building, so without a reading from
        torch or nvidia-smi this host's one earlier class with this TensorRT version in `engines` names it."""
        sm = self.sm or _earlier_sm(engines, self.tensorrt_version)
        # Probed, not declared: the TensorRT version may be unknown (""), which a [[build.classes]] entry may not be.
        return BuildClass.model_construct(
            name=str(DeviceClass.this_host(sm, self.tensorrt_version)),
            tensorrt=self.tensorrt_version or "",
            sm=sm or "",
            builder=self.choice.builder,
        )


def probe_host(choice: Choice) -> Host:
    """Learn the TensorRT version and GPU of the chosen builder (nothing for "no builder")."""
    if choice.builder == "python":
        return Host(choice, python_api.tensorrt_version(), local_sm())
    if choice.builder == "trtexec":
        assert choice.trtexec is not None
        with tempfile.TemporaryDirectory() as scratch:
            version = trtexec.probe_version(choice.trtexec, Path(scratch))
        return Host(choice, version, local_sm())
    return Host(choice)


def _earlier_sm(engines: Path, version: str | None) -> str | None:
    """The GPU of the one `engines/local-<sm>-trt<version>` directory, None when there is none or several."""
    names = [path.name for path in engines.iterdir()] if version and engines.is_dir() else []
    sms = [k.sm for k in map(host_class, names) if k is not None and k.sm and k.tensorrt == version]
    return sms[0] if len(sms) == 1 else None
