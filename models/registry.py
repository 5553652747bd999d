"""Name → builder map and the input spec each architecture expects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torchvision import models as tv

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


def _torchvision(factory: Callable[..., nn.Module]) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, in_channels: int) -> nn.Module:
        return factory(weights=None, num_classes=num_classes)  # random init: nothing is downloaded

    return build


MODELS: dict[str, ModelSpec] = {
    "small_cnn": ModelSpec(small_cnn, channels=None, min_size=8),
    "resnet18": ModelSpec(_torchvision(tv.resnet18), channels=3, min_size=32),
    "mobilenet_v3_small": ModelSpec(_torchvision(tv.mobilenet_v3_small), channels=3, min_size=32),
}


def spec_for(name: str) -> ModelSpec:
    """The spec of a registered model, or a one-line error listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise PipelineError(f"model.name: unknown model {name!r} (known: {', '.join(MODELS)})") from None


def build_model(name: str, num_classes: int, in_channels: int, weights: Path | None = None) -> nn.Module:
    """Build `name`; load the user's safetensors `weights` strictly when given."""
    model = spec_for(name).build(num_classes, in_channels)
    if weights is not None:
        try:
            state = load_file(str(weights))
        except (FileNotFoundError, SafetensorError, OSError) as err:
            raise PipelineError(f"model.weights: {weights}: {err}") from None
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[1].strip() if "\n" in str(err) else str(err)
            raise PipelineError(f"model.weights: {weights} does not fit {name}: {first}") from None
    return model
