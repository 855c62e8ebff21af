"""The shared preprocessing against torch: the resize to 1e-5 and the whole pipeline against a torch reference;
colour "L" (one grey channel) against PIL's convert("L"); RGB/BGR output pinned by checksum."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from serving.preprocessing import (
    LUMA_WEIGHTS,
    PREPROCESSING_VERSION,
    PreprocessSpec,
    input_channels,
    preprocess,
    resize_bilinear,
)

ROOT = Path(__file__).resolve().parents[2]

SIZES = [
    ((17, 23), (64, 64)),  # up both ways
    ((300, 200), (64, 64)),  # down both ways
    ((64, 64), (64, 64)),  # identity
    ((5, 5), (1, 1)),  # down to a single pixel
    ((1, 1), (7, 3)),  # up from a single pixel
    ((480, 640), (224, 224)),  # large: float32 coordinates near 500 have a 3e-5 ulp
    ((10, 100), (40, 13)),  # mixed: up in height, down in width
    ((100, 10), (13, 40)),  # mixed: down in height, up in width
    ((1, 9), (4, 1)),  # size-1 edges on both sides
    ((7, 1), (1, 5)),
    ((64, 64), (64, 17)),  # one axis unchanged
]


def torch_resize(images: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference: NHWC in and out, interpolate on NCHW."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2)
    y = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=False)
    return y.permute(0, 2, 3, 1).numpy()


def torch_preprocess(images: np.ndarray, spec: PreprocessSpec) -> np.ndarray:
    """A straightforward torch version of the same steps (torchvision is not installed)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    x = F.interpolate(x, size=(spec.height, spec.width), mode="bilinear", align_corners=False)
    mean, std = torch.tensor(spec.mean), torch.tensor(spec.std)
    if spec.colour == "L":
        x = (x * torch.tensor(LUMA_WEIGHTS).view(1, 3, 1, 1)).sum(dim=1, keepdim=True)
        return ((x - mean.view(1, 1, 1, 1)) / std.view(1, 1, 1, 1)).numpy()
    if spec.colour == "BGR":
        x, mean, std = x.flip(1), mean.flip(0), std.flip(0)
    return ((x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)).numpy()


def uint8_images(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(("size_in", "size_out"), SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", [1.0, 255.0], ids=["unit", "0-255"])
def test_resize_matches_torch_interpolate(size_in: tuple[int, int], size_out: tuple[int, int], scale: float) -> None:
    rng = np.random.default_rng(sum(size_in) * 1000 + sum(size_out))
    images = (rng.random((3, *size_in, 3)) * scale).astype(np.float32)
    got = resize_bilinear(images, *size_out)
    expected = torch_resize(images, *size_out)
    assert got.shape == expected.shape == (3, *size_out, 3)
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() / scale <= 1e-5


def test_resize_keeps_rank_and_casts_any_real_dtype() -> None:
    image = uint8_images(1, 9, 11)[0]
    got = resize_bilinear(image, 4, 6)  # (H, W, C) in, (H, W, C) out
    expected = torch_resize(image[np.newaxis].astype(np.float32), 4, 6)[0]
    assert got.shape == (4, 6, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=255e-5)
    assert resize_bilinear(image.astype(np.float64), 4, 6).dtype == np.float32


def test_resize_of_the_same_size_is_a_copy_not_a_view() -> None:
    images = np.random.default_rng(1).random((2, 8, 8, 3), dtype=np.float32)
    out = resize_bilinear(images, 8, 8)
    np.testing.assert_array_equal(out, images)
    assert not np.shares_memory(out, images)


def test_resize_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"expects \(N, H, W, C\) or \(H, W, C\), got shape \(4, 4\)"):
        resize_bilinear(np.zeros((4, 4)), 2, 2)
    with pytest.raises(ValueError, match="output size must be >= 1, got 0x2"):
        resize_bilinear(np.zeros((4, 4, 3)), 0, 2)
    with pytest.raises(ValueError, match="empty spatial axis"):
        resize_bilinear(np.zeros((1, 0, 4, 3)), 2, 2)


@pytest.mark.parametrize("colour", ["RGB", "BGR"])
@pytest.mark.parametrize(("height", "width"), [(64, 64), (200, 150), (31, 97)])
def test_preprocess_matches_a_torch_reference(colour: str, height: int, width: int) -> None:
    spec = PreprocessSpec(height=48, width=40, colour=colour)  # type: ignore[arg-type]
    images = uint8_images(5, height, width, seed=height)
    got = preprocess(images, spec)
    assert got.shape == (5, 3, 48, 40)
    assert got.dtype == np.float32
    assert got.flags.c_contiguous
    # Normalised values are up to ~2.6 / 0.225 in size; 1e-5 is float32 rounding, not an algorithm difference.
    np.testing.assert_allclose(got, torch_preprocess(images, spec), rtol=0, atol=1e-5)


def test_bgr_is_rgb_with_the_channels_reversed() -> None:
    images = uint8_images(4, 70, 50)
    rgb = preprocess(images, PreprocessSpec(colour="RGB"))
    bgr = preprocess(images, PreprocessSpec(colour="BGR"))
    np.testing.assert_array_equal(bgr, rgb[:, ::-1])


def test_normalisation_is_per_channel_after_scaling_to_unit() -> None:
    # A flat image survives any resize unchanged, so the output is (value / 255 - mean) / std exactly.
    images = np.empty((1, 10, 10, 3), dtype=np.uint8)
    images[..., 0], images[..., 1], images[..., 2] = 0, 128, 255
    spec = PreprocessSpec(height=4, width=4, mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.125))
    out = preprocess(images, spec)
    expected = [(0 - 0.1) / 0.5, (128 / 255 - 0.2) / 0.25, (1 - 0.3) / 0.125]
    for channel, value in enumerate(expected):
        np.testing.assert_allclose(out[0, channel], value, rtol=1e-6)


def test_a_list_of_differently_sized_images_keeps_its_order() -> None:
    spec = PreprocessSpec(height=32, width=32)
    sizes = [(40, 60), (500, 400), (40, 60), (32, 32), (500, 400)]
    images = [uint8_images(1, h, w, seed=i)[0] for i, (h, w) in enumerate(sizes)]
    got = preprocess(images, spec)
    assert got.shape == (5, 3, 32, 32) and got.flags.c_contiguous
    for i, image in enumerate(images):
        np.testing.assert_array_equal(got[i], preprocess(image[np.newaxis], spec)[0])


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (np.zeros((64, 64, 3), np.uint8), r"got an array of shape \(64, 64, 3\)"),
        (np.zeros((2, 64, 64, 4), np.uint8), r"expects a \(N, H, W, 3\) uint8 RGB array .*shape \(2, 64, 64, 4\)"),
        (np.zeros((2, 64, 64, 1), np.uint8), r"shape \(2, 64, 64, 1\)"),
        (
            [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8), np.uint8)],
            r"image 1 has shape \(8, 8\); expected \(H, W, 3\)",
        ),
        (np.zeros((0, 64, 64, 3), np.uint8), r"the batch is empty \(shape \(0, 64, 64, 3\)\)"),
        ([], "empty batch"),
        (np.zeros((1, 8, 8, 3), np.float32), "dtype float32; expected uint8"),
    ],
    ids=["no-batch-axis", "rgba", "grey", "list-grey", "empty-array", "empty-list", "float"],
)
def test_preprocess_names_what_is_wrong(images: np.ndarray | list[np.ndarray], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preprocess(images, PreprocessSpec())


def test_spec_round_trips_through_a_dict() -> None:
    spec = PreprocessSpec(height=32, width=48, colour="BGR", mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    raw = spec.to_dict()
    assert raw == {
        "height": 32,
        "width": 48,
        "colour": "BGR",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.5, 1.0],
        "interpolation": "bilinear",
        "version": PREPROCESSING_VERSION,
    }
    assert PreprocessSpec.from_dict(raw) == spec
    assert PreprocessSpec.from_dict(PreprocessSpec().to_dict()) == PreprocessSpec()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"extra": 1}, r"unknown field\(s\) \['extra'\]; allowed fields are \['height', 'width'"),
        ({"height": 0}, "height must be a positive integer, got 0"),
        ({"width": 1.5}, "width must be a positive integer, got 1.5"),
        ({"height": True}, "height must be a positive integer, got True"),
        ({"colour": "rgb"}, r"colour must be one of \['RGB', 'BGR', 'L'\], got 'rgb'"),
        ({"interpolation": "nearest"}, r"interpolation must be one of \['bilinear'\], got 'nearest'"),
        ({"mean": [0.5, 0.5]}, r"mean must be three numbers \(R, G, B\)"),
        ({"mean": [0.5, "a", 0.5]}, "mean must be three finite numbers"),
        ({"std": [0.5, 0.0, 0.5]}, r"std must be three numbers > 0"),
        ({"std": [0.5, float("nan"), 0.5]}, "std must be three finite numbers"),
        ({"version": "0"}, r"version must be '1' \(the algorithm this code implements\), got '0'"),
    ],
)
def test_from_dict_is_strict(change: dict[str, object], message: str) -> None:
    raw = {**PreprocessSpec().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        PreprocessSpec.from_dict(raw)


def test_from_dict_wants_every_field() -> None:
    raw = PreprocessSpec().to_dict()
    del raw["std"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['std'\]"):
        PreprocessSpec.from_dict(raw)


def test_the_module_imports_only_numpy_and_the_standard_library() -> None:
    # A fresh interpreter: this test process has torch loaded already.
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import serving.preprocessing\n"
        "banned = ['torch', 'prefect', 'mlflow', 'sluicegate', 'tasks', 'flows', 'onnxruntime', 'PIL']\n"
        "assert not [name for name in banned if name in sys.modules], sorted(sys.modules)\n"
        "added = {name.split('.')[0] for name in set(sys.modules) - before} - set(sys.stdlib_module_names)\n"
        "assert added <= {'numpy', 'serving'}, sorted(added)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# Colour "L": one grey channel.

GREY = PreprocessSpec(height=48, width=40, colour="L", mean=(0.45,), std=(0.25,))
IDENTITY_GREY = PreprocessSpec(height=48, width=40, colour="L", mean=(0.0,), std=(1.0,))


def test_channels_follow_the_colour() -> None:
    assert (PreprocessSpec().channels, PreprocessSpec(colour="BGR").channels, GREY.channels) == (3, 3, 1)
    assert input_channels(GREY.to_dict()) == 1 and input_channels(PreprocessSpec().to_dict()) == 3
    assert input_channels({}) == 3  # a hand-written config without a colour: the old 3-channel contract


@pytest.mark.parametrize(("height", "width"), [(48, 40), (200, 150), (31, 97)])
def test_grey_matches_a_torch_reference(height: int, width: int) -> None:
    images = uint8_images(4, height, width, seed=height)
    got = preprocess(images, GREY)
    assert got.shape == (4, 1, 48, 40) and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, torch_preprocess(images, GREY), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("height", "width"), [(48, 40), (120, 90)], ids=["same-size", "resized"])
def test_grey_is_pils_convert_l_within_one_grey_level(height: int, width: int) -> None:
    """PIL rounds its luma to uint8, this keeps it in float32: they differ by at most half a grey level,
    and a resize (linear, like the luma) keeps that bound."""
    images = uint8_images(3, height, width, seed=5)
    pil = np.stack([np.asarray(Image.fromarray(image).convert("L"), dtype=np.float32) / 255 for image in images])
    expected = resize_bilinear(pil[..., np.newaxis], 48, 40)[..., 0]
    got = preprocess(images, IDENTITY_GREY)[:, 0]
    assert np.abs(got - expected).max() <= 1 / 255


def test_a_grey_image_keeps_its_grey_value_exactly() -> None:
    """For R == G == B the luma is the grey value itself, bit for bit, resized or not; so an "L" model sees
    the same numbers as channel 0 of an RGB model with the same statistics."""
    grey = uint8_images(3, 90, 70, seed=9)[..., 0]
    rgb = np.repeat(grey[..., np.newaxis], 3, axis=-1)
    got = preprocess(rgb, GREY)
    same = preprocess(rgb, PreprocessSpec(height=48, width=40, mean=(0.45,) * 3, std=(0.25,) * 3))
    np.testing.assert_array_equal(got[:, 0], same[:, 0])
    # Without a resize (which blends neighbours, exact only up to rounding) the output is the formula.
    flat = np.full((1, 10, 10, 3), 77, dtype=np.uint8)
    spec = PreprocessSpec(height=10, width=10, colour="L", mean=(0.45,), std=(0.25,))
    expected = (np.float32(77) / np.float32(255) - np.float32(0.45)) / np.float32(0.25)
    np.testing.assert_array_equal(preprocess(flat, spec), np.full((1, 1, 10, 10), expected, dtype=np.float32))


def test_grey_of_a_list_of_differently_sized_images_keeps_its_order() -> None:
    sizes = [(40, 60), (600, 500), (40, 60), (32, 32)]
    images = [uint8_images(1, h, w, seed=i)[0] for i, (h, w) in enumerate(sizes)]
    got = preprocess(images, GREY)
    assert got.shape == (4, 1, 48, 40) and got.flags.c_contiguous
    for i, image in enumerate(images):
        np.testing.assert_array_equal(got[i], preprocess(image[np.newaxis], GREY)[0])


def test_grey_spec_round_trips_through_a_dict() -> None:
    raw = GREY.to_dict()
    assert raw == {
        "height": 48,
        "width": 40,
        "colour": "L",
        "mean": [0.45],
        "std": [0.25],
        "interpolation": "bilinear",
        "version": PREPROCESSING_VERSION,
    }
    assert PreprocessSpec.from_dict(raw) == GREY and hash(PreprocessSpec.from_dict(raw)) == hash(GREY)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"colour": "L"},  # the default (RGB) statistics: three values
            r"mean has 3 value\(s\) \[0.485, 0.456, 0.406\], but colour 'L' has one grey channel: give one value, "
            r"e.g. mean=\[0.4590\] \(their luma\), or use colour 'RGB'/'BGR'",
        ),
        (
            {"colour": "L", "mean": [0.5], "std": [0.2, 0.2]},
            r"std has 2 value\(s\) .* give one value, e.g. std=\[0.5\]",
        ),
        ({"colour": "L", "mean": [], "std": [0.2]}, r"mean has 0 value\(s\) \[\], but colour 'L' has one grey channel"),
        ({"colour": "L", "mean": [0.5], "std": [0.0]}, r"std must be one number > 0 \(the grey channel's\)"),
        ({"colour": "L", "mean": ["a"], "std": [1.0]}, r"mean must be one finite number \(the grey channel's\)"),
        ({"colour": "L", "mean": 0.5, "std": [1.0]}, r"mean must be one number \(the grey channel's\) for colour 'L'"),
        (
            {"mean": [0.5], "std": [0.25]},
            r"mean must be three numbers \(R, G, B\) for colour 'RGB', got 1 value\(s\) \[0.5\]: give three, "
            r"e.g. mean=\[0.5\] \* 3, or use colour 'L' for one grey channel",
        ),
        ({"colour": "BGR", "std": [0.25]}, r"std must be three numbers \(R, G, B\) for colour 'BGR'"),
    ],
)
def test_mean_and_std_must_fit_the_colour(change: dict[str, object], message: str) -> None:
    raw = {**PreprocessSpec().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        PreprocessSpec.from_dict(raw)
    with pytest.raises(ValueError, match=message):
        PreprocessSpec(**{k: v for k, v in change.items()})  # type: ignore[arg-type]


def test_a_grey_spec_refuses_grey_arrays_it_was_not_promised() -> None:
    """The input contract stays uint8 RGB for every colour: a grey file is decoded to RGB first."""
    with pytest.raises(ValueError, match=r"shape \(2, 8, 8, 1\)"):
        preprocess(np.zeros((2, 8, 8, 1), np.uint8), GREY)


# Checksums of preprocess's output made by the code before colour "L" existed (commit 24b3017), on
# images built from arithmetic (no random generator whose stream could change between numpy versions).
# float32 +, -, *, / are correctly rounded, so the bytes are the same on any IEEE machine.
OLD_OUTPUT_SHA256 = {
    ("RGB", "batch"): "c2d38fc667d42bbdbfaf97b5bfb0d61fa25a41be5446c928eedd966a11bbde00",
    ("RGB", "list"): "dbbb0593a2c051dd3f333eb2e85ed566d941cf4e4161b9dff29d4758e43c2861",
    ("BGR", "batch"): "6518e4021ad8b6e6eed3d8534fccbb8f1aaab788f51ff4d930887cdc229af07d",
    ("BGR", "list"): "1ea01cffa7d6b16a1829a9ac01021fa56e1a90487f427d4cde193c13ea9bda54",
    ("default", "batch"): "1393e904278f8516ee5e0ff99816df8ad867fdc25bcfad0bcae2fccc71b78d47",
}


def pattern(n: int, height: int, width: int, salt: int) -> np.ndarray:
    i = np.arange(n * height * width * 3, dtype=np.int64)
    return ((i * 7919 + salt * 104729 + (i // 5) ** 2) % 256).astype(np.uint8).reshape(n, height, width, 3)


@pytest.mark.parametrize("key", sorted(OLD_OUTPUT_SHA256), ids=lambda k: "-".join(k))
def test_stored_rgb_and_bgr_specs_load_and_preprocess_bit_identically(key: tuple[str, str]) -> None:
    colour, form = key
    # A spec dict as older releases stored it in config.json: 3-element lists, RGB or BGR.
    stored = {
        "height": 48,
        "width": 40,
        "colour": colour,
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.25, 0.3],
        "interpolation": "bilinear",
        "version": "1",
    }
    spec = PreprocessSpec() if colour == "default" else PreprocessSpec.from_dict(stored)
    assert spec.channels == 3 and spec.to_dict() == (PreprocessSpec().to_dict() if colour == "default" else stored)
    if form == "batch":
        images: np.ndarray | list[np.ndarray] = pattern(3, 90, 70, 1)
    else:
        images = [pattern(1, h, w, k)[0] for k, (h, w) in enumerate([(40, 60), (600, 500), (32, 32)])]
    assert hashlib.sha256(preprocess(images, spec).tobytes()).hexdigest() == OLD_OUTPUT_SHA256[key]
