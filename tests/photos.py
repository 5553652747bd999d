"""A folder of real photographs, one sub-folder per class, built at test time from what Debian packages ship.

Tux Paint's stamps (Debian `tuxpaint-stamps-default`, GPL-2) are photographs of animals, fruit and flowers, each
cut out of its background (RGBA PNGs, 32-670 px). Each class here is a stamp category with 18-40 distinct photos:
birds, flowers, fruit, mammals, vegetables. Drawings (`cartoon/`, `toys/`) are left
out. Every photo is written once, rescaled so its longer side is 150-460 px, in a mix of the formats and colour
modes a phone or camera folder holds: JPEG (alpha flattened on white), grayscale PNG, RGBA PNG (alpha kept) and
RGB PNG. The choice per file is seeded, so the folder is the same on every machine.

scikit-learn's two sample photographs (`load_sample_images`: a Chinese temple, a flower) are always there; the
fast tests that need a few real images and no training cut them into tiles (:func:`sample_tiles`).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from PIL import Image

STAMPS = Path("/usr/share/tuxpaint/stamps")
PHOTO_PACKAGE = "tuxpaint-stamps-default"
CLASSES = {
    "birds": ["animals/birds"],
    "flowers": ["plants/flowers"],
    "fruit": ["food/fruit"],
    "vegetables": ["food/vegetables"],
    "mammals": ["animals/mammals"],
}
PER_CLASS = 40
"""At most this many photos per class (mammals have 64)."""
DRAWINGS = ("cartoon", "toys")
FORMATS = (("jpeg", 0.45), ("gray", 0.2), ("rgba", 0.2), ("rgb", 0.15))


def available() -> bool:
    """True when the stamps package is installed (`make test` installs it; tests skip, saying so, without)."""
    return all((STAMPS / d).is_dir() for dirs in CLASSES.values() for d in dirs)


def sources(klass: str) -> list[Path]:
    """The class's photographs: raster stamps of its categories, drawings excluded, sorted, at most PER_CLASS."""
    found = sorted(
        p
        for d in CLASSES[klass]
        for p in (STAMPS / d).rglob("*.png")
        if not any(part in DRAWINGS for part in p.relative_to(STAMPS).parts)
    )
    return random.Random(klass).sample(found, PER_CLASS) if len(found) > PER_CLASS else found


def _flat(image: Image.Image) -> Image.Image:
    """The photo on a white background, as RGB."""
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def write_photo(source: Path, dest: Path, rng: random.Random) -> Path:
    """Rescale `source` to a longer side of 150-460 px and write it in a seeded format; returns the file."""
    image = Image.open(source)
    image.load()
    side = rng.randint(150, 460)
    scale = side / max(image.size)
    image = image.convert("RGBA").resize(
        (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.Resampling.LANCZOS
    )
    kind = rng.choices([k for k, _ in FORMATS], weights=[w for _, w in FORMATS])[0]
    if kind == "jpeg":
        path = dest.with_suffix(".jpg")
        _flat(image).save(path, quality=90)
    elif kind == "gray":
        path = dest.with_suffix(".png")
        _flat(image).convert("L").save(path)
    elif kind == "rgba":
        path = dest.with_suffix(".png")
        image.save(path)
    else:
        path = dest.with_suffix(".png")
        _flat(image).save(path)
    return path


def build(root: Path, seed: int = 0) -> Path:
    """Write the photo folder under `root` (one sub-folder per class) and return `root`."""
    rng = random.Random(seed)
    for klass in CLASSES:
        (root / klass).mkdir(parents=True, exist_ok=True)
        for i, source in enumerate(sources(klass)):
            write_photo(source, root / klass / f"{i:03d}-{source.stem}", rng)
    return root


def sample_tiles(root: Path, per_class: int = 6, size: int = 160) -> Path:
    """scikit-learn's two sample photos, each cut into `per_class` tiles of `size` px: a two-class folder."""
    from sklearn.datasets import load_sample_images

    bunch = load_sample_images()
    for name, photo in zip(bunch.filenames, bunch.images, strict=True):
        klass = Path(name).stem
        (root / klass).mkdir(parents=True, exist_ok=True)
        h, w = photo.shape[:2]
        for i in range(per_class):
            y, x = (i * 97) % (h - size), (i * 151) % (w - size)
            tile = Image.fromarray(np.ascontiguousarray(photo[y : y + size, x : x + size]))
            (tile.convert("L") if i % 3 == 2 else tile).save(root / klass / f"{i:02d}.{'jpg' if i % 2 else 'png'}")
    return root
