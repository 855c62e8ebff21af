"""is_grey and common_size on stats of real encoded images (PNG and TIFF files made with PIL)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tasks.image_stats import ImageStats, common_size, image_stats, is_grey

RAMP = (np.arange(12 * 10).reshape(12, 10) * 7 % 256).astype(np.uint8)  # 10 wide, 12 high


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def stats_of(image: Image.Image, fmt: str = "PNG", path: str = "x.png") -> ImageStats:
    return image_stats(path, encoded(image, fmt))


def colour(width: int = 10, height: int = 12, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


GREY_FILES = {
    "1": (Image.fromarray(RAMP).convert("1"), "PNG"),
    "L": (Image.fromarray(RAMP), "PNG"),
    "LA": (Image.fromarray(RAMP).convert("LA"), "PNG"),
    "I;16": (Image.fromarray(RAMP.astype(np.uint16) * 200), "PNG"),
    "I": (Image.fromarray(RAMP.astype(np.int32) * 1000), "TIFF"),
    "F": (Image.fromarray(RAMP.astype(np.float32) / 7), "TIFF"),
}


@pytest.mark.parametrize("mode", sorted(GREY_FILES))
def test_files_in_a_grey_mode_are_grey(mode: str) -> None:
    image, fmt = GREY_FILES[mode]
    stats = stats_of(image, fmt)
    assert stats.mode == mode
    assert is_grey([stats])


def test_a_grey_picture_saved_as_rgb_is_grey_by_its_channel_means() -> None:
    rgb = Image.fromarray(RAMP).convert("RGB")
    stats = stats_of(rgb)
    assert stats.mode == "RGB" and is_grey([stats])
    palette = stats_of(Image.fromarray(RAMP).convert("RGB").quantize(16))  # a palette of greys
    assert palette.mode == "P" and is_grey([palette])


def test_one_colour_image_makes_the_dataset_not_grey() -> None:
    greys = [stats_of(image, fmt) for image, fmt in GREY_FILES.values()]
    assert is_grey(greys)
    assert not is_grey([*greys, stats_of(colour())])
    assert not is_grey([stats_of(colour().quantize(16))])  # a colour palette
    # Nearly grey is not grey: one channel a grey level apart.
    tinted = np.repeat(RAMP[..., None], 3, axis=-1)
    tinted[..., 2] = np.minimum(tinted[..., 2].astype(np.int16) + 1, 255).astype(np.uint8)
    assert not is_grey([stats_of(Image.fromarray(tinted))])


def test_the_mode_decides_before_the_means() -> None:
    # A file that says it is grey is grey, whatever its (here made-up) channel means; the means only
    # decide for files in a colour mode.
    said_grey = ImageStats("a.png", "0" * 64, True, 4, 4, "L", (1.0, 2.0, 3.0))
    rgb_equal = ImageStats("b.png", "1" * 64, True, 4, 4, "RGB", (9.0, 9.0, 9.0))
    rgb_unequal = ImageStats("c.png", "2" * 64, True, 4, 4, "RGB", (9.0, 9.0, 9.5))
    assert is_grey([said_grey, rgb_equal])
    assert not is_grey([said_grey, rgb_unequal])


def test_undecodable_images_are_skipped_and_none_decodable_is_not_grey() -> None:
    broken = image_stats("broken.png", b"not an image")
    missing = ImageStats("gone.png", None, decodable=False, error="missing")
    assert not broken.decodable
    assert is_grey([broken, stats_of(Image.fromarray(RAMP)), missing])
    assert not is_grey([broken, missing])
    assert not is_grey([])


def test_common_size_is_the_most_common_width_and_height() -> None:
    stats = [stats_of(colour(10, 12, seed=i)) for i in range(3)]
    stats += [stats_of(colour(30, 20, seed=9)), image_stats("broken.png", b"nope")]
    assert common_size(stats) == (10, 12)
    assert (stats[0].width, stats[0].height) == (10, 12)


def test_common_size_ties_do_not_depend_on_the_order() -> None:
    stats = [stats_of(colour(10, 12)), stats_of(colour(30, 20)), stats_of(colour(20, 30))]
    assert common_size(stats) == common_size(stats[::-1]) == (30, 20)  # larger area, then larger width


def test_common_size_without_decodable_images_is_none() -> None:
    assert common_size([]) is None
    assert common_size([image_stats("broken.png", b"nope")]) is None
