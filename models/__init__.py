"""Model builders by name. Each declares its input spec; nothing is downloaded at run time."""

from models.registry import MODELS, ModelSpec, build_model, load_weights, read_weights, spec_for

__all__ = ["MODELS", "ModelSpec", "build_model", "load_weights", "read_weights", "spec_for"]
