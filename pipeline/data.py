"""Datasets: scikit-learn's bundled handwritten digits, the user's own ImageFolder, or synthetic patterns.

All three give a stratified, seeded train/validation split of (C, H, W) float tensors, normalised, plus a
`DatasetInfo` that travels with the model (class names, channels, size, normalisation) so that the device
side can preprocess exactly as training did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, TensorDataset

from pipeline.config import DataConfig
from pipeline.errors import PipelineError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}
# What Pillow raises on a file it cannot decode: not an image, truncated, corrupt chunks, a decompression bomb.
BAD_IMAGE = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)

Stats = tuple[list[float], list[float]]
"""Per-channel (mean, std) that images are normalised with."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a deployed model needs to know about its inputs."""

    classes: list[str]
    channels: int
    image_size: int
    mean: list[float]
    std: list[float]
    normalization: str = "dataset"
    """Where `mean` and `std` come from: `dataset` (the training split), `imagenet`, `recorded` (a trained model's
    model.json, for export and the holdout), or `weights` (what `model.weights` was trained with)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for model.json and ONNX metadata."""
        return asdict(self)


@dataclass
class Splits:
    """Train and validation datasets plus their shared description."""

    train: Dataset
    """Training images as training sees them (ImageFolder: augmented when `data.augment`)."""
    val: Dataset
    info: DatasetInfo
    train_eval: Dataset
    """The same training images as validation sees them, unaugmented: for BatchNorm statistics and calibration."""
    skipped: list[str] = field(default_factory=list)
    """`path: reason` of each unreadable image left out (`data.on_bad_image = "skip"`)."""


def _split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.arange(len(labels))
    try:
        train_idx, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=labels)
    except ValueError:  # a class of one image (a camera's rare scene) cannot be on both sides: split at random
        train_idx, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed)
    return np.sort(train_idx), np.sort(val_idx)


def imagenet_stats(channels: int) -> Stats:
    """ImageNet's statistics, which published weights were trained with; one channel gets their average."""
    if channels == 3:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [sum(IMAGENET_MEAN) / 3], [sum(IMAGENET_STD) / 3]


def wants_imagenet(cfg: DataConfig, pretrained: bool) -> bool:
    """`data.normalize`: `auto` is ImageNet's statistics when starting from a weights file, the data's otherwise."""
    return cfg.normalize == "imagenet" or (cfg.normalize == "auto" and pretrained)


def choose_norm(cfg: DataConfig, channels: int, pretrained: bool, prior: Stats | None, stats: Stats | None) -> Norm:
    """How `load` normalises: `stats` (a trained model's) when given; else, with `data.normalize = "auto"` and
    `prior` (the statistics a weights file of this pipeline was trained with, one per channel), those: the weights
    expect inputs scaled as in their own training, and ImageNet's would shift every first-layer input; else as
    :func:`wants_imagenet` says."""
    if stats is None and cfg.normalize == "auto" and prior is not None and len(prior[0]) == channels:
        return Norm(prior, source="weights")
    return Norm(stats, wants_imagenet(cfg, pretrained))


def _tensor_splits(
    x: torch.Tensor, y: torch.Tensor, classes: list[str], cfg: DataConfig, seed: int, norm: Norm
) -> Splits:
    """Normalise (by default with the training split's statistics) and wrap as TensorDatasets."""
    train_idx, val_idx = _split(y.numpy(), cfg.val_fraction, seed)
    mean, std, how = norm.resolve(x.shape[1], lambda: _tensor_stats(x[train_idx]))
    m, s = torch.tensor(mean)[None, :, None, None], torch.tensor(std)[None, :, None, None]
    x = (x - m) / s
    info = DatasetInfo(classes, x.shape[1], cfg.image_size, mean, std, how)
    train = TensorDataset(x[train_idx], y[train_idx])
    return Splits(train, TensorDataset(x[val_idx], y[val_idx]), info, train)


def _tensor_stats(x: torch.Tensor) -> Stats:
    return x.mean(dim=(0, 2, 3)).tolist(), x.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()


@dataclass(frozen=True)
class Norm:
    """How to pick the normalisation: given statistics (model.json), ImageNet's, or computed from the data."""

    given: Stats | None = None
    imagenet: bool = False
    source: str = "recorded"
    """What `given` is, for DatasetInfo.normalization: `recorded` (a trained model's) or `weights`."""

    def resolve(self, channels: int, compute: Callable[[], Stats]) -> tuple[list[float], list[float], str]:
        """(mean, std, where they come from)."""
        if self.given is not None:
            return [float(v) for v in self.given[0]], [float(v) for v in self.given[1]], self.source
        if self.imagenet:
            return (*imagenet_stats(channels), "imagenet")
        return (*compute(), "dataset")


def _resize(x: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.expand(-1, channels, -1, -1).contiguous() if x.shape[1] != channels else x


def _digits(cfg: DataConfig, seed: int, channels: int, norm: Norm) -> Splits:
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return _tensor_splits(_resize(x, cfg.image_size, channels), y, [str(c) for c in range(10)], cfg, seed, norm)


def _synthetic(cfg: DataConfig, seed: int, channels: int, norm: Norm) -> Splits:
    """Each class is a fixed random template plus noise: learnable, but not trivially so."""
    gen = torch.Generator().manual_seed(seed)
    templates = torch.rand(cfg.synthetic_classes, channels, 8, 8, generator=gen)
    y = torch.arange(cfg.synthetic_samples) % cfg.synthetic_classes
    x = templates[y] + 0.35 * torch.randn(cfg.synthetic_samples, channels, 8, 8, generator=gen)
    classes = [f"class_{i}" for i in range(cfg.synthetic_classes)]
    return _tensor_splits(_resize(x, cfg.image_size, channels), y, classes, cfg, seed, norm)


def open_image(path: Path, channels: int) -> Image.Image:
    """Decode an image file as RGB (or L for one channel); transparent parts are laid on white, as viewers show
    them (converting RGBA straight to RGB would expose whatever colour hides under the transparent pixels)."""
    with Image.open(path) as image:
        image.load()
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return image.convert("RGB" if channels == 3 else "L")


class ImageFiles(Dataset):
    """Image files with their labels, decoded by :func:`open_image` and then transformed."""

    def __init__(self, items: list[tuple[Path, int]], channels: int, transform: Callable[[Image.Image], Any]) -> None:
        self.items, self.channels, self.transform = items, channels, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[index]
        return self.transform(open_image(path, self.channels)), label


def _image_paths(folder: Path) -> list[Path]:
    """Every path under `folder` named as an image, sorted. Symbolic links count as what they lead to (a file is read
    through its link, wherever it lies, as by everything else that opens it); one that leads nowhere is one line
    naming it, where each reader would otherwise fail on it its own way (a traceback, a checksum)."""
    found = sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES)
    for path in found:
        if path.is_symlink() and not path.exists():
            raise PipelineError(f"data.path: {path}: a symbolic link to {path.readlink()}, which does not exist")
    return found


def class_files(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Class names (sorted sub-directories) and every image file under them with its label."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    items = [
        (path, label) for label, name in enumerate(classes) for path in _image_paths(root / name) if path.is_file()
    ]
    empty = sorted(set(classes) - {classes[label] for _, label in items})
    if not classes or empty:
        what = f"no image files in {', '.join(empty)}" if empty else "no class sub-directories"
        raise PipelineError(f"data.path: {root}: {what} ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return classes, items


def _pixel_sums(image: torch.Tensor) -> np.ndarray:
    """Per channel: sum and sum of squares of an image's values, for the dataset's mean and std."""
    flat = image.flatten(1).double()
    return torch.stack([flat.sum(1), (flat**2).sum(1)]).numpy()


def scan(cfg: DataConfig, channels: int) -> tuple[list[str], list[tuple[Path, int]], list[np.ndarray], list[str]]:
    """Decode every image once, before any DataLoader does: classes, the readable files, their pixel sums (as
    validation sees them) and the unreadable ones as `path: reason`.

    With `data.on_bad_image = "error"` the first unreadable file is a one-line error naming it.
    """
    _check_dir(cfg)
    assert cfg.path is not None  # enforced by DataConfig
    classes, items = class_files(cfg.path)
    plain = eval_transform(cfg)
    good, sums, skipped = [], [], []
    for path, label in items:
        try:
            image = plain(open_image(path, channels))
        except BAD_IMAGE as err:
            reason = f"{path}: unreadable image ({_why(err, path)})"
            if cfg.on_bad_image == "error":
                raise PipelineError(f'data.path: {reason}; remove it or set data.on_bad_image = "skip"') from None
            skipped.append(reason)
            continue
        good.append((path, label))
        sums.append(_pixel_sums(image))
    return classes, good, sums, skipped


def _why(err: BaseException, path: Path) -> str:
    """The error's type and first line, without the path Pillow repeats in it."""
    lines = str(err).splitlines()
    text = (lines[0] if lines else "").replace(f"'{path}'", "").replace(str(path), "").strip(" :")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def eval_transform(cfg: DataConfig) -> Callable[[Image.Image], torch.Tensor]:
    """Resize to `image_size` squared and scale to [0, 1]: what validation, export and the device do."""
    from torchvision import transforms

    return transforms.Compose([transforms.Resize((cfg.image_size, cfg.image_size)), transforms.ToTensor()])


def train_transform(cfg: DataConfig) -> Callable[[Image.Image], torch.Tensor]:
    """Training's view of an image: a random resized crop and a horizontal flip (`data.augment`), else as validation
    sees it. Photos of a few dozen per class are learnt, not memorised, only with such variation."""
    from torchvision import transforms

    if not cfg.augment:
        return eval_transform(cfg)
    steps: list[Callable[..., Any]] = [
        transforms.RandomResizedCrop(cfg.image_size, scale=(cfg.crop_scale, 1.0), antialias=True)
    ]
    if cfg.hflip:
        steps.append(transforms.RandomHorizontalFlip())
    return transforms.Compose([*steps, transforms.ToTensor()])


def _normalized(transform: Callable[[Image.Image], torch.Tensor], stats: Stats) -> Callable[[Image.Image], Any]:
    from torchvision import transforms

    return transforms.Compose([transform, transforms.Normalize(*stats)])


def _sums_stats(sums: list[np.ndarray], pixels: int) -> Stats:
    total = np.sum(sums, axis=0)
    count = pixels * len(sums)
    mean = total[0] / count
    std = np.sqrt(np.maximum(total[1] / count - mean**2, 1e-12))
    return mean.tolist(), std.tolist()


def _imagefolder(cfg: DataConfig, seed: int, channels: int, norm: Norm) -> Splits:
    classes, items, sums, skipped = scan(cfg, channels)
    train_idx, val_idx = _split(np.array([label for _, label in items]), cfg.val_fraction, seed)
    mean, std, how = norm.resolve(channels, lambda: _sums_stats([sums[i] for i in train_idx], cfg.image_size**2))
    train_items, val_items = [items[i] for i in train_idx], [items[i] for i in val_idx]
    plain = _normalized(eval_transform(cfg), (mean, std))
    return Splits(
        train=ImageFiles(train_items, channels, _normalized(train_transform(cfg), (mean, std))),
        val=ImageFiles(val_items, channels, plain),
        info=DatasetInfo(classes, channels, cfg.image_size, mean, std, how),
        train_eval=ImageFiles(train_items, channels, plain),
        skipped=skipped,
    )


def _check_dir(cfg: DataConfig) -> None:
    if cfg.source == "imagefolder" and not (cfg.path and cfg.path.is_dir()):
        raise PipelineError(f"data.path: {cfg.path} is not a directory")


def check_source(cfg: DataConfig) -> None:
    """Fail early, with one line, when the configured data cannot be read (before any rank starts): no folder, no
    images in a class, or, with `data.on_bad_image = "error"`, a file that does not decode. A rank that failed
    instead would take the whole torchrun job down with a traceback per rank."""
    _check_dir(cfg)
    if cfg.source == "imagefolder" and cfg.on_bad_image == "error":
        scan(cfg, channels=3)


def native_channels(cfg: DataConfig) -> int:
    """Channels the configured source has: 1 for the digits, 3 otherwise."""
    return 1 if cfg.source == "digits" else 3


def load(
    cfg: DataConfig,
    seed: int,
    channels: int | None = None,
    *,
    pretrained: bool = False,
    prior: Stats | None = None,
    stats: Stats | None = None,
) -> Splits:
    """Load the configured dataset as a seeded split; `channels` forces 1 or 3 channels for the model.

    Normalisation: `stats` when given (a trained model's, from model.json), else as `data.normalize` says: `auto`
    with `pretrained` (training starts from a weights file) is `prior` (what that file was trained with, when this
    pipeline wrote it) or ImageNet's.
    """
    channels = channels or native_channels(cfg)
    loader = {"digits": _digits, "synthetic": _synthetic, "imagefolder": _imagefolder}[cfg.source]
    return loader(cfg, seed, channels, choose_norm(cfg, channels, pretrained, prior, stats))


def fingerprint(cfg: DataConfig) -> str:
    """sha256 that changes when the data changes: file names, sizes and mtimes for ImageFolder."""
    digest = hashlib.sha256(repr(sorted(cfg.model_dump(mode="json").items())).encode())
    if cfg.source == "imagefolder" and cfg.path is not None and cfg.path.is_dir():
        for f in _image_paths(cfg.path):
            stat = f.stat()
            digest.update(f"{f.relative_to(cfg.path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def val_batch(splits: Splits, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `n` validation images and labels as one batch (deterministic for a given seed)."""
    n = min(n, len(splits.val))  # type: ignore[arg-type]
    items = [splits.val[i] for i in range(n)]
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])
