"""The one image preprocessing implementation, shared by training (tasks/) and the model server.

It lives in serving/ because the server image carries only serving dependencies; training imports it
from here, so the tensors a model was trained on and the tensors it is served are made by the same
code. Only numpy and the standard library are imported.

The resize reproduces ``torch.nn.functional.interpolate(x, size, mode="bilinear", align_corners=False)``
(no antialiasing), the resize models are trained with, so exporting a model never changes its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt

# Bump when the algorithm changes (not its parameters): a stored spec of another version cannot be
# reproduced by this code, so from_dict refuses it instead of silently preprocessing differently.
PREPROCESSING_VERSION = "1"

Colour = Literal["RGB", "BGR"]
Interpolation = Literal["bilinear"]
_COLOURS: tuple[str, ...] = get_args(Colour)
_INTERPOLATIONS: tuple[str, ...] = get_args(Interpolation)

Float32Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class PreprocessSpec:
    """What a model expects as input; stored with the model (config.json) and compared by the feature gate.

    ``mean`` and ``std`` are in RGB order and apply after scaling to [0, 1]; with ``colour="BGR"`` they
    are reordered together with the channels.
    """

    height: int = 64
    width: int = 64
    colour: Colour = "RGB"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    interpolation: Interpolation = "bilinear"
    version: str = PREPROCESSING_VERSION

    def __post_init__(self) -> None:
        # Validate here, not only in from_dict, so a bad spec cannot exist however it was built.
        for name in ("height", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PreprocessSpec.{name} must be a positive integer, got {value!r}")
        if self.colour not in _COLOURS:
            raise ValueError(f"PreprocessSpec.colour must be one of {list(_COLOURS)}, got {self.colour!r}")
        if self.interpolation not in _INTERPOLATIONS:
            raise ValueError(
                f"PreprocessSpec.interpolation must be one of {list(_INTERPOLATIONS)}, got {self.interpolation!r}"
            )
        if self.version != PREPROCESSING_VERSION:
            raise ValueError(
                f"PreprocessSpec.version must be {PREPROCESSING_VERSION!r} (the algorithm this code implements), "
                f"got {self.version!r}"
            )
        # JSON gives lists; store tuples of floats so specs compare and hash by value.
        object.__setattr__(self, "mean", _three_floats("mean", self.mean, positive=False))
        object.__setattr__(self, "std", _three_floats("std", self.std, positive=True))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every field (lists for mean/std)."""
        return {
            "height": self.height,
            "width": self.width,
            "colour": self.colour,
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PreprocessSpec:
        """The spec a ``to_dict`` wrote.

        Strict: every field must be present (a stored spec is machine-written and complete, and a
        default filled in silently could differ from what the model was trained with).

        Raises:
            ValueError: unknown or missing keys, or a bad value; the message names the field and the
                allowed values.
        """
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ValueError(f"PreprocessSpec: unknown field(s) {unknown}; allowed fields are {allowed}")
        missing = [name for name in allowed if name not in raw]
        if missing:
            raise ValueError(f"PreprocessSpec: missing field(s) {missing}; a stored spec lists all of {allowed}")
        return cls(**raw)


def _three_floats(name: str, value: Any, *, positive: bool) -> tuple[float, float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"PreprocessSpec.{name} must be three numbers (R, G, B), got {value!r}")
    out: list[float] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise ValueError(f"PreprocessSpec.{name} must be three finite numbers (R, G, B), got {value!r}")
        if positive and item <= 0:
            raise ValueError(f"PreprocessSpec.{name} must be three numbers > 0 (R, G, B), got {value!r}")
        out.append(float(item))
    return out[0], out[1], out[2]


def _axis_weights(
    in_size: int, out_size: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], Float32Array, Float32Array]:
    """Source indices and weights of one axis, as torch's CPU bilinear kernel computes them.

    torch computes ``scale * (i + 0.5) - 0.5`` in float32 for float tensors, and its CPU build fuses the
    multiply-add (one rounding). A float32 coordinate near 500 has an ulp of 3e-5, so rounding twice
    instead would move the weights, and the output, by up to that much. Here the float32 ``scale`` is
    applied in float64, where the product is exact, and rounded to float32 once: the fused result.
    """
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    centres = np.arange(out_size, dtype=np.float64) + 0.5
    src = (scale * centres - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))  # align_corners=False clamps negative positions to the edge
    i0 = np.minimum(src.astype(np.intp), in_size - 1)  # src >= 0, so truncation is floor
    i1 = np.minimum(i0 + 1, in_size - 1)
    w1 = (src - i0.astype(np.float32)).astype(np.float32)
    w0 = (np.float32(1.0) - w1).astype(np.float32)
    return i0, i1, w0, w1


def _resize_axis(
    x: npt.NDArray[Any], axis: int, out_size: int, to_float: Callable[[npt.NDArray[Any]], Float32Array]
) -> Float32Array:
    in_size = x.shape[axis]
    if in_size == out_size:
        return to_float(x)  # torch's weights are exactly (1, 0) here: a copy, so skip the blend
    i0, i1, w0, w1 = _axis_weights(in_size, out_size)
    shape = [1] * x.ndim
    shape[axis] = out_size
    out = to_float(np.take(x, i0, axis=axis))
    out *= w0.reshape(shape)
    far = to_float(np.take(x, i1, axis=axis))
    far *= w1.reshape(shape)
    out += far
    return out


def _as_float32(x: npt.NDArray[Any]) -> Float32Array:
    return np.asarray(x, dtype=np.float32)


def _resize(
    batch: npt.NDArray[Any], height: int, width: int, to_float: Callable[[npt.NDArray[Any]], Float32Array]
) -> Float32Array:
    """``(N, H, W, C)`` -> float32 ``(N, height, width, C)``.

    ``to_float`` turns raw values into float32 ones. It runs on what the first axis gathers, not on the
    whole input: converting a 480x640 image that is shrunk to 64 rows would otherwise cost more than
    the resize. Gathering is exact, so the values are the same as converting first.
    """
    in_h, in_w = batch.shape[1], batch.shape[2]
    # Resizing rows first costs height * in_w per channel, columns first in_h * width: take the cheaper.
    if height * in_w <= in_h * width:
        return _resize_axis(_resize_axis(batch, 1, height, to_float), 2, width, _as_float32)
    return _resize_axis(_resize_axis(batch, 2, width, to_float), 1, height, _as_float32)


def resize_bilinear(images: npt.NDArray[Any], height: int, width: int) -> Float32Array:
    """Bilinear resize matching torch's ``interpolate(mode="bilinear", align_corners=False)``.

    Separable: one gather-and-blend per axis, the axis that shrinks the work most first.

    Args:
        images: ``(N, H, W, C)`` or ``(H, W, C)``, any real dtype (values are not rescaled or rounded).
        height: output height, >= 1.
        width: output width, >= 1.

    Returns:
        A new float32 array of the same rank, ``(N, height, width, C)`` or ``(height, width, C)``.

    Raises:
        ValueError: wrong rank, an empty spatial axis, or a non-positive output size.
    """
    if images.ndim not in (3, 4):
        raise ValueError(f"resize_bilinear expects (N, H, W, C) or (H, W, C), got shape {images.shape}")
    if height < 1 or width < 1:
        raise ValueError(f"resize_bilinear output size must be >= 1, got {height}x{width}")
    batch = images if images.ndim == 4 else images[np.newaxis]
    if batch.shape[1] < 1 or batch.shape[2] < 1:
        raise ValueError(f"resize_bilinear input has an empty spatial axis: shape {images.shape}")
    out = _resize(batch, height, width, _as_float32)
    if np.may_share_memory(out, images):
        out = out.copy()  # float32 in, same size out: never hand back (a view of) the caller's array
    return out if images.ndim == 4 else out[0]


def _scale_to_unit(x: npt.NDArray[Any]) -> Float32Array:
    # x / 255 in float32, as torch's ``x.float() / 255`` (a true division, not a multiply by 1/255).
    return np.divide(x, np.float32(255.0), dtype=np.float32)


def preprocess(images: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]], spec: PreprocessSpec) -> Float32Array:
    """Model input from uint8 RGB images: scale to [0, 1], resize, reorder channels, normalise.

    Args:
        images: ``(N, H, W, 3)`` uint8 RGB, or a sequence of ``(H, W, 3)`` uint8 RGB arrays whose
            sizes may differ.
        spec: the model's preprocessing.

    Returns:
        C-contiguous float32 ``(N, 3, spec.height, spec.width)`` (NCHW), channels in ``spec.colour`` order.

    Raises:
        ValueError: an empty batch, wrong rank, not 3 channels or not uint8; the message gives the
            shape (or dtype) received and the one expected.
    """
    groups = _batches(images)
    count = sum(len(batch) for _, batch in groups)
    out = np.empty((count, 3, spec.height, spec.width), dtype=np.float32)
    order = (0, 1, 2) if spec.colour == "RGB" else (2, 1, 0)
    for positions, batch in groups:
        resized = _resize(batch, spec.height, spec.width, _scale_to_unit)
        for channel, source in enumerate(order):
            # One pass per channel does the reorder, the NHWC -> NCHW transpose and the normalisation.
            out[positions, channel] = (resized[..., source] - np.float32(spec.mean[source])) / np.float32(
                spec.std[source]
            )
    return out


_EXPECTED = "(N, H, W, 3) uint8 RGB array or a sequence of (H, W, 3) uint8 RGB arrays"


def _batches(
    images: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
) -> list[tuple[slice | list[int], npt.NDArray[np.uint8]]]:
    """Validated ``(N, H, W, 3)`` batches with the output positions they fill.

    A sequence is grouped by image size, so same-sized images are resized together (vectorised).
    """
    if isinstance(images, np.ndarray):
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"preprocess expects a {_EXPECTED}; got an array of shape {images.shape}")
        _check_image(images, "the batch")
        return [(slice(0, images.shape[0]), images)]
    if len(images) == 0:
        raise ValueError(f"preprocess got an empty batch (no images); expected a {_EXPECTED}")
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for index, image in enumerate(images):
        array = np.asarray(image)
        if array.ndim != 3 or array.shape[-1] != 3:
            raise ValueError(f"preprocess: image {index} has shape {array.shape}; expected (H, W, 3) uint8 RGB")
        _check_image(array, f"image {index}")
        by_shape.setdefault(array.shape, []).append(index)
    return [(positions, np.stack([np.asarray(images[i]) for i in positions])) for positions in by_shape.values()]


def _check_image(array: npt.NDArray[Any], what: str) -> None:
    if array.size == 0:
        raise ValueError(f"preprocess: {what} is empty (shape {array.shape}); expected a {_EXPECTED}")
    if array.dtype != np.uint8:
        raise ValueError(f"preprocess: {what} has dtype {array.dtype}; expected uint8 (0..255) RGB")
