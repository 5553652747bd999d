"""Build stage: a verified TensorRT engine per device class, or an honest skip (with reasons) where none is built."""

from pipeline.build.stage import run

__all__ = ["run"]
