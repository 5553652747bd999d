"""Build stage: a verified TensorRT engine per device class, or an honest skip (with reasons) where none is built."""

from pipeline.engines.stage import STAGE, run

__all__ = ["STAGE", "run"]
