"""scikit-learn's handwritten digits as one ImageFolder per device, split by a Dirichlet label skew: each device sees
some digits often and others rarely or never, as each camera sees its own scenes (federated training's tests and
benchmark)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def dirichlet_split(labels: np.ndarray, devices: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Indices of each device's images: every class's images dealt out in Dirichlet(`alpha`) proportions (small
    `alpha`: strong skew)."""
    rng = np.random.default_rng(seed)
    shares: list[list[int]] = [[] for _ in range(devices)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet([alpha] * devices))[:-1] * len(members)).astype(int)
        for device, part in enumerate(np.split(members, cuts)):
            shares[device] += part.tolist()
    return [np.array(sorted(s), dtype=int) for s in shares]


def write_digit_folders(roots: list[Path], alpha: float, seed: int = 0, size: int = 8) -> list[dict[str, int]]:
    """Each root gets `<digit>/<n>.png` for its share (every class folder exists, maybe empty but for one image, so
    every device has the same class names); returns each device's image count per class. A `size` above the digits'
    8 px writes them as a camera would: scaled up, with sensor noise (so their files are as big as real frames)."""
    digits = load_digits()
    images = (digits.images * (255 / 16)).astype(np.uint8)
    if size != 8:
        images = _as_camera_frames(images, size, np.random.default_rng(seed))
    counts = []
    for root, indices in zip(roots, dirichlet_split(digits.target, len(roots), alpha, seed), strict=True):
        count = {str(c): 0 for c in range(10)}
        for c in range(10):
            (root / str(c)).mkdir(parents=True, exist_ok=True)
        # A class folder with no image would be dropped by the folder scan: one image keeps the class names equal.
        keep = set(indices.tolist()) | {int(np.flatnonzero(digits.target == c)[0]) for c in range(10)}
        for i in sorted(keep):
            label = str(digits.target[i])
            Image.fromarray(images[i]).save(root / label / f"{i}.png")
            count[label] += 1
        counts.append(count)
    return counts


def _as_camera_frames(images: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    frames = np.stack([np.asarray(Image.fromarray(i).resize((size, size), Image.Resampling.BICUBIC)) for i in images])
    noisy = frames.astype(np.int16) + rng.normal(0, 6, frames.shape).round().astype(np.int16)
    return noisy.clip(0, 255).astype(np.uint8)
