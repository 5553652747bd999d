"""Datasets: scikit-learn's bundled handwritten digits, the user's own ImageFolder, or synthetic patterns.

All three give a stratified, seeded train/validation split of (C, H, W) float tensors, normalised, plus a
`DatasetInfo` that travels with the model (class names, channels, size, normalisation) so that the device
side can preprocess exactly as training did.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, Subset, TensorDataset

from pipeline.config import DataConfig
from pipeline.errors import PipelineError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}


@dataclass(frozen=True)
class DatasetInfo:
    """What a deployed model needs to know about its inputs."""

    classes: list[str]
    channels: int
    image_size: int
    mean: list[float]
    std: list[float]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for model.json and ONNX metadata."""
        return asdict(self)


@dataclass
class Splits:
    """Train and validation datasets plus their shared description."""

    train: Dataset
    val: Dataset
    info: DatasetInfo


def _split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(len(labels))
    train_idx, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=labels)
    return np.sort(train_idx), np.sort(val_idx)


def _tensor_splits(x: torch.Tensor, y: torch.Tensor, classes: list[str], cfg: DataConfig, seed: int) -> Splits:
    """Normalise with the training split's statistics and wrap as TensorDatasets."""
    train_idx, val_idx = _split(y.numpy(), cfg.val_fraction, seed)
    mean = x[train_idx].mean(dim=(0, 2, 3))
    std = x[train_idx].std(dim=(0, 2, 3)).clamp_min(1e-6)
    x = (x - mean[None, :, None, None]) / std[None, :, None, None]
    info = DatasetInfo(classes, x.shape[1], cfg.image_size, mean.tolist(), std.tolist())
    return Splits(TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx]), info)


def _resize(x: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.expand(-1, channels, -1, -1).contiguous() if x.shape[1] != channels else x


def _digits(cfg: DataConfig, seed: int, channels: int) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return _tensor_splits(_resize(x, cfg.image_size, channels), y, [str(c) for c in range(10)], cfg, seed)


def _synthetic(cfg: DataConfig, seed: int, channels: int) -> Splits:
    """Each class is a fixed random template plus noise: learnable, but not trivially so."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.rand(cfg.synthetic_classes, channels, 8, 8, generator=gen)
    y = torch.arange(cfg.synthetic_samples) % cfg.synthetic_classes
    x = templates[y] + 0.35 * torch.randn(cfg.synthetic_samples, channels, 8, 8, generator=gen)
    classes = [f"class_{i}" for i in range(cfg.synthetic_classes)]
    return _tensor_splits(_resize(x, cfg.image_size, channels), y, classes, cfg, seed)


def check_source(cfg: DataConfig) -> None:
    """Fail early, with one line, when the configured data cannot be read (before any rank starts)."""
    if cfg.source == "imagefolder" and not (cfg.path and cfg.path.is_dir()):
        raise PipelineError(f"data.path: {cfg.path} is not a directory")


def _imagefolder(cfg: DataConfig, seed: int, channels: int) -> Splits:
    from torchvision import datasets, transforms

    check_source(cfg)
    root = cfg.path
    assert root is not None  # enforced by DataConfig
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
    steps = [transforms.Resize((cfg.image_size, cfg.image_size))]
    if channels == 1:
        steps.append(transforms.Grayscale(num_output_channels=1))
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        ds = datasets.ImageFolder(str(root), transform=transforms.Compose(steps))
    except (FileNotFoundError, RuntimeError) as err:
        raise PipelineError(f"data.path: {root}: {err}") from None
    train_idx, val_idx = _split(np.array(ds.targets), cfg.val_fraction, seed)
    info = DatasetInfo(list(ds.classes), channels, cfg.image_size, list(mean), list(std))
    return Splits(Subset(ds, train_idx.tolist()), Subset(ds, val_idx.tolist()), info)


def load(cfg: DataConfig, seed: int, channels: int | None = None) -> Splits:
    """Load the configured dataset as a seeded split; `channels` forces 1 or 3 channels for the model."""
    native = {"digits": 1, "synthetic": 3, "imagefolder": 3}[cfg.source]
    channels = channels or native
    loader = {"digits": _digits, "synthetic": _synthetic, "imagefolder": _imagefolder}[cfg.source]
    return loader(cfg, seed, channels)


def fingerprint(cfg: DataConfig) -> str:
    """sha256 that changes when the data changes: file names, sizes and mtimes for ImageFolder."""
    digest = hashlib.sha256(repr(sorted(cfg.model_dump(mode="json").items())).encode())
    if cfg.source == "imagefolder" and cfg.path is not None and cfg.path.is_dir():
        for f in sorted(p for p in cfg.path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
            stat = f.stat()
            digest.update(f"{f.relative_to(cfg.path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def val_batch(splits: Splits, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` validation images and labels as one batch (deterministic for a given seed)."""
    n = min(n, len(splits.val))  # type: ignore[arg-type]
    items = [splits.val[i] for i in range(n)]
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])
