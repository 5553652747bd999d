"""A small CNN for low-resolution images such as the built-in 8x8 digits (upscaled)."""

from __future__ import annotations

from torch import nn


def small_cnn(num_classes: int, in_channels: int) -> nn.Module:
    """Two conv blocks and a linear head; ~20k parameters (19,658 for 10 classes), trains in seconds on a CPU."""

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(
        block(in_channels, 32),
        nn.MaxPool2d(2),
        block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )
