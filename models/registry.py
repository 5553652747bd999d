"""Name → builder map and the input spec each architecture expects."""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from models.small_cnn import small_cnn
from pipeline.errors import PipelineError


@dataclass(frozen=True)
class ModelSpec:
    """What an architecture needs from the data."""

    build: Callable[[int, int], nn.Module]
    """(num_classes, in_channels) → freshly initialised module."""
    channels: int | None
    """Input channels it requires; None means it adapts to the data's."""
    min_size: int
    """Smallest input side it accepts."""
    head: str
    """State-dict prefix of the classifier's last layer: the tensors replaced when a weights file has another
    class count."""


def _torchvision(name: str) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, in_channels: int) -> nn.Module:
        # Imported when built: torchvision imports all of its models and torch._dynamo, 1.8 s that every rank of a
        # small_cnn run would pay for nothing.
        factory = getattr(importlib.import_module("torchvision.models"), name)
        return factory(weights=None, num_classes=num_classes)  # random init: nothing is downloaded

    return build


MODELS: dict[str, ModelSpec] = {
    "small_cnn": ModelSpec(small_cnn, channels=None, min_size=8, head="5."),
    "resnet18": ModelSpec(_torchvision("resnet18"), channels=3, min_size=32, head="fc."),
    "mobilenet_v3_small": ModelSpec(_torchvision("mobilenet_v3_small"), channels=3, min_size=32, head="classifier.3."),
}


def spec_for(name: str) -> ModelSpec:
    """The spec of a registered model, or a one-line error listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise PipelineError(f"model.name: unknown model {name!r} (known: {', '.join(MODELS)})") from None


def build_model(name: str, num_classes: int, in_channels: int) -> nn.Module:
    """Build `name`, freshly initialised (from the global torch seed)."""
    return spec_for(name).build(num_classes, in_channels)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a safetensors file, or from a torch `.pth` (torchvision's published files) read with
    `weights_only=True`, so that a file holding anything but tensors is refused before any of it runs."""
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message is a page of advice; the line that names what was refused is the one worth showing.
        lines = [line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line]
        why = lines[0] if lines else _first(err)
        raise PipelineError(f"model.weights: {path}: refused by weights_only loading: {why}") from None
    except (FileNotFoundError, SafetensorError, OSError, RuntimeError, EOFError) as err:
        raise PipelineError(f"model.weights: {path}: cannot read weights: {_first(err)}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise PipelineError(f"model.weights: {path}: not a state dict (names to tensors)")
    return state


def load_weights(model: nn.Module, name: str, path: Path) -> list[str]:
    """Load `path` into `model` (an architecture `name`); returns the tensors dropped, as `name [shape]`.

    Only the classifier head may differ, in shape (another class count): those tensors keep their fresh
    initialisation. Anything else that does not match is a one-line error.
    """
    state, own, head = read_weights(path), model.state_dict(), spec_for(name).head
    dropped = [k for k, t in state.items() if k.startswith(head) and k in own and own[k].shape != t.shape]
    kept = {k: t for k, t in state.items() if k not in dropped}
    try:
        result = model.load_state_dict(kept, strict=False)
    except RuntimeError as err:
        raise PipelineError(f"model.weights: {path} does not fit {name}: {_first(err, 1)}") from None
    missing = [k for k in result.missing_keys if k not in dropped]
    if missing or result.unexpected_keys:
        what = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(result.unexpected_keys[:3])}"
        raise PipelineError(f"model.weights: {path} does not fit {name}: {what}")
    return [f"{k} {list(state[k].shape)}" for k in dropped]


def _first(err: BaseException, line: int = 0) -> str:
    """A useful line of an error: load_state_dict puts a generic header first and the detail on the next line."""
    lines = [text.strip() for text in str(err).splitlines() if text.strip()]
    return lines[min(line, len(lines) - 1)] if lines else type(err).__name__
