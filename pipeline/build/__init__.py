"""Build stage: a TensorRT engine for this host's device class, or an honest skip when TensorRT is absent."""

from pipeline.build.stage import run

__all__ = ["run"]
