"""ImageFolder data: real photos in mixed formats and colour modes, unreadable files, augmentation, normalisation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import data
from pipeline.config import DataConfig
from pipeline.errors import PipelineError
from tests import photos

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiles(tmp_path: Path) -> Path:
    """scikit-learn's two sample photos cut into 6 tiles each: PNG and JPEG, RGB and grayscale."""
    return photos.sample_tiles(tmp_path / "photos")


def folder(path: Path, **keys: object) -> DataConfig:
    return DataConfig.model_validate({"source": "imagefolder", "path": str(path), "image_size": 32, **keys})


def spoil(root: Path) -> list[Path]:
    """A text file named .jpg and a JPEG cut short: what a camera card or a failed copy leaves behind."""
    text = root / "china" / "notes.jpg"
    text.write_text("not an image")
    cut = root / "flower" / "cut.jpg"
    whole = (root / "flower" / "01.jpg").read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    return [text, cut]


def test_an_unreadable_image_is_one_line_naming_it(tiles: Path) -> None:
    bad = spoil(tiles)
    with pytest.raises(PipelineError) as err:
        data.load(folder(tiles), seed=0)
    message = str(err.value)
    assert "\n" not in message and str(bad[0]) in message and "on_bad_image" in message


def test_skip_leaves_unreadable_images_out_and_counts_them(tiles: Path) -> None:
    bad = spoil(tiles)
    splits = data.load(folder(tiles, on_bad_image="skip"), seed=0)
    assert sorted(reason.split(": unreadable")[0] for reason in splits.skipped) == sorted(map(str, bad))
    assert len(splits.train) + len(splits.val) == 12  # type: ignore[arg-type]
    for x, _ in [splits.train[i] for i in range(len(splits.train))]:  # type: ignore[arg-type]
        assert x.shape == (3, 32, 32)


def test_the_cli_stops_before_training_with_one_line_and_exit_2(tiles: Path, tmp_path: Path) -> None:
    bad = spoil(tiles)
    cmd = [sys.executable, "-m", "pipeline", "train", "--run-dir", str(tmp_path / "run")]
    cmd += ["--set", "data.source=imagefolder", "--set", f"data.path={tiles}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and str(bad[0]) in proc.stderr


def test_transparent_pixels_are_laid_on_white(tmp_path: Path) -> None:
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)  # black and fully transparent ...
    rgba[2:6, 2:6] = (200, 10, 10, 255)  # ... around an opaque red square
    Image.fromarray(rgba, "RGBA").save(tmp_path / "cut-out.png")
    image = np.asarray(data.open_image(tmp_path / "cut-out.png", channels=3))
    assert image[0, 0].tolist() == [255, 255, 255] and image[3, 3].tolist() == [200, 10, 10]


def test_training_images_are_augmented_and_validation_images_never(tiles: Path) -> None:
    splits = data.load(folder(tiles), seed=0)
    torch.manual_seed(0)
    assert not torch.equal(splits.train[0][0], splits.train[0][0])  # a new crop and flip on every read
    assert torch.equal(splits.val[0][0], splits.val[0][0])
    assert torch.equal(splits.train_eval[0][0], splits.train_eval[0][0])
    fixed = data.load(folder(tiles, augment=False), seed=0)
    assert torch.equal(fixed.train[0][0], fixed.train_eval[0][0])


def test_normalisation_from_the_training_split_imagenet_or_recorded(tiles: Path) -> None:
    own = data.load(folder(tiles), seed=0)
    assert own.info.normalization == "dataset"
    plain = torch.stack([own.train_eval[i][0] for i in range(len(own.train_eval))])  # type: ignore[arg-type]
    assert plain.mean(dim=(0, 2, 3)).abs().max() < 1e-4  # normalised with its own statistics: mean 0, std 1
    assert plain.std(dim=(0, 2, 3)).sub(1).abs().max() < 1e-2
    pretrained = data.load(folder(tiles), seed=0, pretrained=True)
    assert (pretrained.info.normalization, pretrained.info.mean) == ("imagenet", list(data.IMAGENET_MEAN))
    assert data.load(folder(tiles, normalize="dataset"), seed=0, pretrained=True).info.mean == own.info.mean
    recorded = data.load(folder(tiles), seed=0, stats=([0.5, 0.5, 0.5], [0.25, 0.25, 0.25]))
    assert (recorded.info.normalization, recorded.info.std) == ("recorded", [0.25, 0.25, 0.25])


def test_auto_normalisation_from_an_earlier_runs_weights_uses_their_statistics(tiles: Path) -> None:
    prior = ([0.6, 0.5, 0.4], [0.3, 0.2, 0.1])  # what a weights file of this pipeline was trained with
    tuned = data.load(folder(tiles), seed=0, pretrained=True, prior=prior)
    assert (tuned.info.normalization, tuned.info.mean, tuned.info.std) == ("weights", *prior)
    plain = data.load(folder(tiles, augment=False, normalize="dataset"), seed=0)
    raw = plain.train_eval[0][0] * torch.tensor(plain.info.std)[:, None, None]
    raw += torch.tensor(plain.info.mean)[:, None, None]
    expected = (raw - torch.tensor(prior[0])[:, None, None]) / torch.tensor(prior[1])[:, None, None]
    assert torch.allclose(tuned.train_eval[0][0], expected, atol=1e-4)  # the images really are scaled by them
    # Set explicitly, data.normalize wins; statistics for another channel count are not these images'.
    assert (
        data.load(folder(tiles, normalize="imagenet"), 0, pretrained=True, prior=prior).info.normalization == "imagenet"
    )
    assert (
        data.load(folder(tiles, normalize="dataset"), 0, pretrained=True, prior=prior).info.normalization == "dataset"
    )
    gray = ([0.5], [0.2])
    assert data.load(folder(tiles), 0, pretrained=True, prior=gray).info.normalization == "imagenet"


@pytest.mark.skipif(not photos.available(), reason=f"needs Debian's {photos.PHOTO_PACKAGE} (make test installs it)")
def test_the_photo_folder_holds_real_photos_in_mixed_formats(tmp_path: Path) -> None:
    root = photos.build(tmp_path / "photos")
    files = [p for p in root.rglob("*") if p.is_file()]
    modes = {(p.suffix, Image.open(p).mode) for p in files}
    assert {(".jpg", "RGB"), (".png", "L"), (".png", "RGBA"), (".png", "RGB")} <= modes
    assert all(150 <= max(Image.open(p).size) <= 460 for p in files)
    assert sorted(d.name for d in root.iterdir()) == sorted(photos.CLASSES)
    assert all(18 <= len(list((root / k).iterdir())) <= 40 for k in photos.CLASSES)
