"""Per-image statistics, computed once per dataset version and shared by the data gate and training:
size, decodability, content hash, per-channel mean (the serving drift baseline), and what they say
about the dataset as a whole (``is_grey``, ``common_size``), from which the pipeline picks a new model's
preprocessing."""

from __future__ import annotations

import hashlib
import io
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sluicegate.errors import DatasetError
from tasks.dataset_source import DatasetSource, map_objects

# PIL modes with one grey band (plus alpha for "LA"): bilevel, 8-bit, 32-bit integer, 16-bit (each byte
# order PIL names) and float. ``Image.convert("RGB")`` copies the band into R, G and B.
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
# Channel means closer than this (0..255 scale) count as equal: equal channels give equal means to the
# last bit, and a colour image is many grey levels away; this only absorbs rounding.
_GREY_TOLERANCE = 1e-3


@dataclass(frozen=True)
class ImageStats:
    path: str
    sha256: str | None  # None when the object is missing
    decodable: bool
    width: int | None = None
    height: int | None = None
    mode: str | None = None
    channel_means: tuple[float, float, float] | None = None  # RGB, 0..255
    error: str | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}" if self.decodable else "undecodable"


def image_stats(path: str, data: bytes) -> ImageStats:
    """Decode one image fully (``verify()`` alone misses truncated pixel data) and measure it."""
    from PIL import Image, UnidentifiedImageError

    digest = hashlib.sha256(data).hexdigest()
    try:
        with Image.open(io.BytesIO(data)) as image:
            mode = image.mode
            rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        return ImageStats(path, digest, decodable=False, error=f"{type(exc).__name__}: {exc}")
    means = rgb.reshape(-1, 3).mean(axis=0)
    return ImageStats(
        path,
        digest,
        decodable=True,
        width=rgb.shape[1],
        height=rgb.shape[0],
        mode=mode,
        channel_means=(float(means[0]), float(means[1]), float(means[2])),
    )


def collect_stats(
    source: DatasetSource,
    paths: Sequence[str],
    *,
    concurrency: int = 16,
    on_image: Callable[[ImageStats], None] | None = None,
) -> list[ImageStats]:
    """Stats of every listed image, streamed from the source in parallel (bounded in flight)."""
    results: list[ImageStats] = []
    for path, outcome in map_objects(source, list(paths), image_stats, concurrency):
        stats = (
            ImageStats(path, None, decodable=False, error=str(outcome))
            if isinstance(outcome, DatasetError)
            else outcome
        )
        results.append(stats)
        if on_image is not None:
            on_image(stats)
    return results


def channel_baseline(stats: Sequence[ImageStats]) -> dict[str, list[float]]:
    """Per-channel means of every decodable image: the drift monitor's reference sample."""
    means = [s.channel_means for s in stats if s.channel_means is not None]
    return {channel: [m[index] for m in means] for index, channel in enumerate(("r", "g", "b"))}


def is_grey(stats: Sequence[ImageStats]) -> bool:
    """Whether every decodable image is grey, so a one-channel (colour "L") model loses nothing.

    An image is grey when its PIL mode is a grey one (``GREY_MODES``); the mode is what the file says
    it is, so it decides. Otherwise (an RGB or palette file) it is grey when its R, G and B means are
    equal, which a grey picture saved as RGB gives (a colour one practically never does: the means would
    have to match to a thousandth of a grey level). Undecodable images are the data gate's business and
    are skipped; with no decodable image at all there is nothing grey, so False.
    """
    decodable = [s for s in stats if s.decodable]
    return bool(decodable) and all(_grey(s) for s in decodable)


def _grey(stats: ImageStats) -> bool:
    if stats.mode in GREY_MODES:
        return True
    means = stats.channel_means
    if means is None:
        return False
    return all(math.isclose(means[0], other, rel_tol=0.0, abs_tol=_GREY_TOLERANCE) for other in means[1:])


def common_size(stats: Sequence[ImageStats]) -> tuple[int, int] | None:
    """The most common ``(width, height)`` of the decodable images; None when there is none.

    Ties go to the larger area, then the larger width, so the answer does not depend on the order of
    ``stats`` (``collect_stats`` returns them in the order their downloads finished).
    """
    sizes = Counter((s.width, s.height) for s in stats if s.decodable and s.width is not None and s.height is not None)
    if not sizes:
        return None
    return max(sizes, key=lambda size: (sizes[size], size[0] * size[1], size[0], size[1]))


def decode_rgb(data: bytes) -> np.ndarray:
    """An image's pixels as uint8 RGB (H, W, 3)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)


def load_images(source: DatasetSource, paths: Sequence[str], *, concurrency: int = 16) -> list[np.ndarray]:
    """Decode the given images (skipping ones that are missing or undecodable: the data gate reports those)."""
    images = []
    for _, outcome in map_objects(source, list(paths), lambda _, data: _try_decode(data), concurrency):
        if isinstance(outcome, np.ndarray):
            images.append(outcome)
    return images


def _try_decode(data: bytes) -> np.ndarray | None:
    try:
        return decode_rgb(data)
    except (OSError, ValueError, SyntaxError):
        return None
