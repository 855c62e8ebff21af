"""The one image preprocessing implementation, shared by training (tasks/) and the model server.

It lives in serving/ because the server image carries only serving dependencies; training imports it
from here, so the tensors a model was trained on and the tensors it is served are made by the same
code. Only numpy and the standard library are imported.

The resize reproduces ``torch.nn.functional.interpolate(x, size, mode="bilinear", align_corners=False)``
(no antialiasing), the reference DESIGN section 6 names; tests/serving checks it to 1e-5.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import numpy.typing as npt

# Bump when the algorithm changes (not its parameters): a stored spec of another version cannot be
# reproduced by this code, so from_dict refuses it instead of silently preprocessing differently.
# Adding colour "L" did not bump it: "RGB" and "BGR" specs produce bit-identical tensors as before
# (tests/serving pins them by checksum), and an "L" spec is new, so no stored version-1 spec can mean
# anything else. Bumping would make every stored spec unreadable for no change in what it computes.
PREPROCESSING_VERSION = "1"

Colour = Literal["RGB", "BGR", "L"]
Interpolation = Literal["bilinear"]
_COLOURS: tuple[str, ...] = get_args(Colour)
# Channels of the tensor ``preprocess`` makes, per colour.
COLOUR_CHANNELS: Mapping[str, int] = {"RGB": 3, "BGR": 3, "L": 1}
_INTERPOLATIONS: tuple[str, ...] = get_args(Interpolation)

Float32Array = npt.NDArray[np.float32]

# ITU-R 601-2 luma, the weights of PIL's ``Image.convert("L")`` (299/587/114 per mille), in RGB order.
LUMA_WEIGHTS: tuple[float, float, float] = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class PreprocessSpec:
    """What a model expects as input; stored with the model (config.json) and compared by the feature gate.

    ``colour`` is "RGB" or "BGR" (three channels) or "L" (one grey channel, the ITU-R 601 luma of the
    RGB input, as PIL's ``convert("L")`` but unrounded). ``mean`` and ``std`` apply after scaling to
    [0, 1]: three values in RGB order for "RGB"/"BGR" (with "BGR" they are reordered together with the
    channels), one value for "L". The defaults are ImageNet's RGB statistics, so an "L" spec names its own.
    """

    height: int = 64
    width: int = 64
    colour: Colour = "RGB"
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
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
        object.__setattr__(self, "mean", _floats("mean", self.mean, self.colour, positive=False))
        object.__setattr__(self, "std", _floats("std", self.std, self.colour, positive=True))

    @property
    def channels(self) -> int:
        """Channels of the model input ``preprocess`` makes: 1 for "L", 3 for "RGB" and "BGR"."""
        return COLOUR_CHANNELS[self.colour]

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


def input_channels(preprocessing: Mapping[str, Any]) -> int:
    """Channels of the image input a ``config.json`` ``preprocessing`` dict describes, read leniently
    (the server also loads hand-written configs): 1 for colour "L", else 3 (RGB, BGR, or no colour)."""
    colour = preprocessing.get("colour")
    return COLOUR_CHANNELS.get(colour, 3) if isinstance(colour, str) else 3


def _floats(name: str, value: Any, colour: str, *, positive: bool) -> tuple[float, ...]:
    """``value`` as a tuple of floats, one per channel of ``colour`` (RGB order for three)."""
    grey = colour == "L"
    what = "one number (the grey channel's)" if grey else "three numbers (R, G, B)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"PreprocessSpec.{name} must be {what} for colour {colour!r}, got {value!r}")
    if len(value) != (1 if grey else 3):
        raise ValueError(_count_message(name, value, colour))
    out: list[float] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Real) or not math.isfinite(item):
            raise ValueError(f"PreprocessSpec.{name} must be {what.replace('number', 'finite number')}, got {value!r}")
        if positive and item <= 0:
            raise ValueError(f"PreprocessSpec.{name} must be {what.replace(' (', ' > 0 (')}, got {value!r}")
        out.append(float(item))
    return tuple(out)


def _count_message(name: str, value: Sequence[Any], colour: str) -> str:
    """Why ``value`` has the wrong length for ``colour``, with a value that would fit."""
    numeric = all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)
    if colour == "L":
        example = "[0.5]"
        if numeric and len(value) == 3:  # the luma of RGB statistics is a fair grey equivalent
            example = f"[{sum(w * float(v) for w, v in zip(LUMA_WEIGHTS, value, strict=True)):.4f}] (their luma)"
        return (
            f"PreprocessSpec.{name} has {len(value)} value(s) {list(value)}, but colour 'L' has one grey channel: "
            f"give one value, e.g. {name}={example}, or use colour 'RGB'/'BGR' for three"
        )
    example = f"[{float(value[0])!r}] * 3" if numeric and len(value) == 1 else "[r, g, b]"
    return (
        f"PreprocessSpec.{name} must be three numbers (R, G, B) for colour {colour!r}, got {len(value)} "
        f"value(s) {list(value)}: give three, e.g. {name}={example}, or use colour 'L' for one grey channel"
    )


# Values per work buffer when resizing a batch in chunks: about 1 MiB of float32, so the intermediate
# rows stay in cache instead of round-tripping batch-sized temporaries through memory (3-4x faster
# on 480x640 inputs).
_CHUNK_VALUES = 1 << 18

# Writes ``src`` as float32 into ``out``: a plain cast, or preprocess's scaling to [0, 1].
Convert = Callable[[npt.NDArray[Any], Float32Array], None]


class _AxisPlan(NamedTuple):
    """Where each output position along one axis reads from, with torch's weights."""

    axis: int
    near: npt.NDArray[np.intp]
    far: npt.NDArray[np.intp]
    near_weight: Float32Array  # shaped to broadcast along ``axis`` of an (N, H, W, C) array
    far_weight: Float32Array


def _plan_axis(axis: int, in_size: int, out_size: int) -> _AxisPlan | None:
    """The plan for one axis, or None when its size does not change (torch's weights are (1, 0): a copy).

    torch computes ``scale * (i + 0.5) - 0.5`` in float32 for float tensors, and its CPU build fuses the
    multiply-add (one rounding). A float32 coordinate near 500 has an ulp of 3e-5, so rounding twice
    instead would move the weights, and the output, by up to that much. Here the float32 ``scale`` is
    applied in float64, where the product is exact, and rounded to float32 once: the fused result.
    """
    if in_size == out_size:
        return None
    scale = np.float64(np.float32(in_size) / np.float32(out_size))
    centres = np.arange(out_size, dtype=np.float64) + 0.5
    src = (scale * centres - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))  # align_corners=False clamps negative positions to the edge
    near = np.minimum(src.astype(np.intp), in_size - 1)  # src >= 0, so truncation is floor
    far = np.minimum(near + 1, in_size - 1)
    far_weight = (src - near.astype(np.float32)).astype(np.float32)
    near_weight = (np.float32(1.0) - far_weight).astype(np.float32)
    shape = [1, 1, 1, 1]
    shape[axis] = out_size
    return _AxisPlan(axis, near, far, near_weight.reshape(shape), far_weight.reshape(shape))


def _gather(
    x: npt.NDArray[Any],
    index: npt.NDArray[np.intp],
    axis: int,
    out: Float32Array,
    raw: npt.NDArray[Any] | None,
    convert: Convert | None,
) -> None:
    # mode="clip" lets take write straight into ``out`` (the default mode buffers); indices are in range.
    if raw is None or convert is None:  # x is float32 already: gather straight into out
        np.take(x, index, axis=axis, out=out, mode="clip")
    else:
        np.take(x, index, axis=axis, out=raw, mode="clip")
        convert(raw, out)


def _blend(
    x: npt.NDArray[Any],
    plan: _AxisPlan,
    out: Float32Array,
    scratch: Float32Array,
    raw: npt.NDArray[Any] | None,
    convert: Convert | None,
) -> None:
    """``out = x[near] * near_weight + x[far] * far_weight`` along the plan's axis, torch's formula."""
    _gather(x, plan.near, plan.axis, out, raw, convert)
    out *= plan.near_weight
    _gather(x, plan.far, plan.axis, scratch, raw, convert)
    scratch *= plan.far_weight
    out += scratch


def _resize(batch: npt.NDArray[Any], height: int, width: int, convert: Convert) -> Float32Array:
    """``(N, H, W, C)`` -> float32 ``(N, height, width, C)``, separably, a few images at a time.

    ``convert`` turns raw values into float32 ones. It runs on what the first axis gathers, not on the
    whole input: converting a 480x640 image that is shrunk to 64 rows would otherwise cost more than
    the resize. Gathering is exact, so the values are the same as converting first.
    """
    n, in_h, in_w, channels = batch.shape
    out = np.empty((n, height, width, channels), dtype=np.float32)
    rows, cols = _plan_axis(1, in_h, height), _plan_axis(2, in_w, width)
    if rows is None and cols is None:
        convert(batch, out)
        return out
    # Rows first gathers whole contiguous rows; columns first is only worth it when it is much less work.
    first, second = (rows, cols) if height * in_w <= 2 * in_h * width else (cols, rows)
    mid_shape = (height, in_w) if first is rows else (in_h, width)
    chunk = max(1, _CHUNK_VALUES // (mid_shape[0] * mid_shape[1] * channels))
    mid = np.empty((min(chunk, n), *mid_shape, channels), dtype=np.float32)
    scratch = np.empty_like(mid)
    raw = np.empty(mid.shape, dtype=batch.dtype)
    scratch_out = np.empty((len(mid), height, width, channels), dtype=np.float32)
    for start in range(0, n, chunk):
        x, target = batch[start : start + chunk], out[start : start + chunk]
        k = len(x)
        if first is None:
            convert(x, mid[:k])
        else:
            _blend(x, first, mid[:k], scratch[:k], raw[:k], convert)
        if second is None:
            target[...] = mid[:k]
        else:
            _blend(mid[:k], second, target, scratch_out[:k], None, None)
    return out


def _cast(src: npt.NDArray[Any], out: Float32Array) -> None:
    np.copyto(out, src, casting="unsafe")


def _scale_to_unit(src: npt.NDArray[Any], out: Float32Array) -> None:
    # x / 255 in float32, as torch's ``x.float() / 255`` (a true division, not a multiply by 1/255).
    np.divide(src, np.float32(255.0), out=out)


def resize_bilinear(images: npt.NDArray[Any], height: int, width: int) -> Float32Array:
    """Bilinear resize matching torch's ``interpolate(mode="bilinear", align_corners=False)``.

    Separable: one vectorised gather-and-blend per axis (rows first unless columns first is much less
    work), over a few images at a time so the intermediates stay in cache.

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
    out = _resize(batch, height, width, _cast)
    return out if images.ndim == 4 else out[0]


def preprocess(images: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]], spec: PreprocessSpec) -> Float32Array:
    """Model input from uint8 RGB images: scale to [0, 1], resize, reorder channels (or make grey), normalise.

    Args:
        images: ``(N, H, W, 3)`` uint8 RGB, or a sequence of ``(H, W, 3)`` uint8 RGB arrays whose
            sizes may differ (also for ``colour="L"``: grey images are decoded to RGB like any other).
        spec: the model's preprocessing.

    Returns:
        C-contiguous float32 ``(N, spec.channels, spec.height, spec.width)`` (NCHW), channels in
        ``spec.colour`` order; for "L" the one channel is the luma of the resized [0, 1] RGB values.

    Raises:
        ValueError: an empty batch, wrong rank, not 3 channels or not uint8; the message gives the
            shape (or dtype) received and the one expected.
    """
    groups = _batches(images)
    count = sum(len(batch) for _, batch in groups)
    out = np.empty((count, spec.channels, spec.height, spec.width), dtype=np.float32)
    if spec.colour == "L":
        for positions, batch in groups:
            out[positions, 0] = _luma(_resize(batch, spec.height, spec.width, _scale_to_unit), spec)
        return out
    order = (0, 1, 2) if spec.colour == "RGB" else (2, 1, 0)
    for positions, batch in groups:
        resized = _resize(batch, spec.height, spec.width, _scale_to_unit)
        for channel, source in enumerate(order):
            # One pass per channel does the reorder, the NHWC -> NCHW transpose and the normalisation.
            out[positions, channel] = (resized[..., source] - np.float32(spec.mean[source])) / np.float32(
                spec.std[source]
            )
    return out


def _luma(resized: Float32Array, spec: PreprocessSpec) -> Float32Array:
    """The normalised grey channel ``(N, H, W)`` of resized [0, 1] RGB values ``(N, H, W, 3)``.

    After the resize, not before: resizing and luma are both linear, so the order changes only float
    rounding, and the resize reads far fewer input pixels than the image has when it shrinks (the usual
    case: 480x640 to 64x64 gathers 128 of 480 rows), while a luma first would touch every input pixel
    once more, in a full-size temporary (32 images of 480x640: ~60 ms for the luma alone, against ~9 ms
    for the whole preprocess either way). Afterwards it is a few passes over the small output, and the
    resize stays one shared code path for every colour. Only a large upscale would favour grey first.

    Written as ``g + wr * (r - g) + wb * (b - g)``: the same weighted sum (the weights add up to 1), but
    exact for grey pixels, where r == g == b, so a grey image's luma is its grey value bit for bit.
    """
    wr, _, wb = (np.float32(w) for w in LUMA_WEIGHTS)
    red, green, blue = resized[..., 0], resized[..., 1], resized[..., 2]
    grey = np.subtract(red, green)
    grey *= wr
    grey += green
    other = np.subtract(blue, green)
    other *= wb
    grey += other
    grey -= np.float32(spec.mean[0])
    grey /= np.float32(spec.std[0])
    return grey


_EXPECTED = "(N, H, W, 3) uint8 RGB array or a sequence of (H, W, 3) uint8 RGB arrays"


def _batches(
    images: npt.NDArray[np.uint8] | Sequence[npt.NDArray[np.uint8]],
) -> list[tuple[slice | list[int], npt.NDArray[np.uint8]]]:
    """Validated ``(N, H, W, 3)`` batches with the output positions they fill.

    A sequence's images may differ in size, so they are grouped: each large image alone, small ones by size.
    """
    if isinstance(images, np.ndarray):
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"preprocess expects a {_EXPECTED}; got an array of shape {images.shape}")
        _check_image(images, "the batch")
        return [(slice(0, images.shape[0]), images)]
    if len(images) == 0:
        raise ValueError(f"preprocess got an empty batch (no images); expected a {_EXPECTED}")
    arrays = [_checked_image(index, image) for index, image in enumerate(images)]
    groups: list[tuple[slice | list[int], npt.NDArray[np.uint8]]] = []
    small: dict[tuple[int, ...], list[int]] = {}
    for index, array in enumerate(arrays):
        if array.size > _CHUNK_VALUES:
            # Resized alone anyway (one image fills a work chunk): a view, since stacking would copy it.
            groups.append((slice(index, index + 1), array[np.newaxis]))
        else:
            small.setdefault(array.shape, []).append(index)
    # Small images of one size are stacked so they are resized together rather than one call each.
    groups.extend((positions, np.stack([arrays[i] for i in positions])) for positions in small.values())
    return groups


def _checked_image(index: int, image: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"preprocess: image {index} has shape {array.shape}; expected (H, W, 3) uint8 RGB")
    _check_image(array, f"image {index}")
    return array


def _check_image(array: npt.NDArray[Any], what: str) -> None:
    if array.size == 0:
        raise ValueError(f"preprocess: {what} is empty (shape {array.shape}); expected a {_EXPECTED}")
    if array.dtype != np.uint8:
        raise ValueError(f"preprocess: {what} has dtype {array.dtype}; expected uint8 (0..255) RGB")
