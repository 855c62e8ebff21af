"""A deterministic synthetic dataset version of PCB solder-joint images, clean or with one planted defect.

``make_sample`` writes a folder that follows the dataset contract (tasks/datasets.py): ``images/*.png``
and ``manifest.csv`` with ``path,label,split,sha256``, ready to upload as ``datasets/<name>/<version>/``.
Each ``Corruption`` plants exactly one defect that one data-gate check exists to catch, and keeps every
other property of the clean dataset, so a demo or a test sees only the intended check fail.

Everything is drawn from ``numpy.random.SeedSequence(seed)``: child 0 lays the dataset out (labels,
splits, corrupted rows) and child ``i + 1`` draws image ``i``, so the same arguments write the same bytes
(on the same numpy, Pillow and zlib builds) and an image never depends on the ones before it.
"""

from __future__ import annotations

import csv
import enum
import hashlib
import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sluicegate.errors import DatasetError
from tasks import pcb_render
from tasks.datasets import MANIFEST

LABELS: tuple[str, ...] = pcb_render.CLASSES
SPLITS = ("train", "val", "test")
UNKNOWN_LABEL = "scratch"
MIN_COUNT = 8
MIN_SIDE = 16


class Corruption(enum.StrEnum):
    """One planted defect; the value is the CLI spelling."""

    # ~15% of rows (the same share of every class) have an empty label: trips "label present" (max 5%).
    MISSING_LABELS = "missing-labels"
    # ~85% of rows are "good", 5% each of the rest: trips "label distribution" (KL vs uniform ~0.8 > 0.3).
    SKEWED_LABELS = "skewed-labels"
    # ~10% of images are 1.5x larger: trips "one image size" (at least 99% share one size).
    MIXED_SIZES = "mixed-sizes"
    # ~1% of files (at least 3) are truncated PNGs or saved S3 error pages, named .png: trips "images decode".
    UNDECODABLE = "undecodable"
    # ~20% of test rows (3% of all, at least 3) are byte-copies of train images of their class: trips
    # "no train/test leakage".
    LEAKAGE = "leakage"
    # ~5% of rows (at least one per class) are labelled "scratch": trips "known labels" wherever the gate knows
    # the label set (settings or champion). One unknown name only: with no known set, the reference is uniform
    # over the labels seen, and a single rare extra label keeps that KL divergence near 0.1, under 0.3.
    UNKNOWN_LABELS = "unknown-labels"


@dataclass(frozen=True)
class SampleSummary:
    """What ``make_sample`` wrote. ``labels`` counts manifest labels ("" for an empty one)."""

    directory: Path
    count: int
    seed: int
    image_size: tuple[int, int]
    labels: dict[str, int]
    splits: dict[str, int]
    corruption: Corruption | None


@dataclass(frozen=True)
class _Row:
    """One manifest row and how to produce its file."""

    label: str  # as written to the manifest
    split: str
    drawn_as: str  # the class the image shows
    source: int  # whose generator draws the image: itself, or for leakage the train image it copies
    size: tuple[int, int]
    damage: str = ""  # "", "truncated" or "error-page"


def make_sample(
    directory: Path,
    count: int = 3000,
    seed: int = 0,
    corrupt: Corruption | None = None,
    image_size: tuple[int, int] = (64, 64),
    on_image: Callable[[int], None] | None = None,
) -> SampleSummary:
    """Write a synthetic dataset version to ``directory`` (created; must be absent or empty).

    Args:
        directory: the dataset version folder to write.
        count: number of images (at least 8).
        seed: makes the output reproducible: the same arguments write byte-identical files.
        corrupt: the one defect to plant, or None for a clean dataset.
        image_size: (width, height) in pixels, each at least 16.
        on_image: called with each image's index once it is written (a progress bar).

    Returns:
        What was written.

    Raises:
        DatasetError: an argument is out of range, or ``directory`` holds files already.
    """
    directory = Path(directory)
    corruption = _check(directory, count, seed, corrupt, image_size)
    root = np.random.SeedSequence(seed)
    layout, *image_seeds = root.spawn(count + 1)
    rows = _plan(np.random.default_rng(layout), count, corruption, image_size)
    images = directory / "images"
    images.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["path", "label", "split", "sha256"])
    for index, row in enumerate(rows):
        data = _encode(pcb_render.render(row.drawn_as, np.random.default_rng(image_seeds[row.source]), row.size))
        if row.damage:
            data = _damage(data, row.damage, index)
        path = f"images/{index:05d}.png"
        (directory / path).write_bytes(data)
        writer.writerow([path, row.label, row.split, hashlib.sha256(data).hexdigest()])
        if on_image is not None:
            on_image(index)
    # The manifest goes last, as in an upload: a folder without one was never finished.
    (directory / MANIFEST).write_text(out.getvalue(), encoding="utf-8", newline="")
    labels = Counter(row.label for row in rows)
    return SampleSummary(
        directory=directory,
        count=count,
        seed=seed,
        image_size=(image_size[0], image_size[1]),
        labels={label: labels[label] for label in sorted(labels, key=_label_order)},
        splits={split: sum(row.split == split for row in rows) for split in SPLITS},
        corruption=corruption,
    )


def _check(
    directory: Path, count: int, seed: int, corrupt: Corruption | str | None, image_size: tuple[int, int]
) -> Corruption | None:
    if count < MIN_COUNT:
        raise DatasetError(f"count={count} is too small: a sample needs at least {MIN_COUNT} images")
    if seed < 0:
        raise DatasetError(f"seed={seed} must be zero or positive")
    if len(image_size) != 2 or min(image_size) < MIN_SIDE:
        raise DatasetError(f"image_size={tuple(image_size)} is too small: width and height must be >= {MIN_SIDE}")
    if directory.exists() and not directory.is_dir():
        raise DatasetError(f"directory {str(directory)!r} is a file; give a new or empty folder")
    if directory.is_dir() and any(directory.iterdir()):
        raise DatasetError(f"directory {str(directory)!r} is not empty; give a new or empty folder")
    try:
        return None if corrupt is None else Corruption(corrupt)
    except ValueError:
        choices = ", ".join(c.value for c in Corruption)
        raise DatasetError(f"corrupt={corrupt!r} is not a corruption; choose one of {choices}") from None


def _plan(rng: np.random.Generator, count: int, corruption: Corruption | None, size: tuple[int, int]) -> list[_Row]:
    drawn = _classes(rng, count, skewed=corruption is Corruption.SKEWED_LABELS)
    splits = _splits(rng, drawn)
    rows = [_Row(c, s, c, i, size) for i, (c, s) in enumerate(zip(drawn, splits, strict=True))]
    if corruption is Corruption.MISSING_LABELS:
        for i in _per_class(rng, drawn, 0.15):
            rows[i] = replace(rows[i], label="")
    elif corruption is Corruption.UNKNOWN_LABELS:
        for i in _per_class(rng, drawn, 0.05):
            rows[i] = replace(rows[i], label=UNKNOWN_LABEL)
    elif corruption is Corruption.MIXED_SIZES:
        bigger = (size[0] * 3 // 2, size[1] * 3 // 2)
        for i in _some(rng, range(count), 0.10, at_least=1):
            rows[i] = replace(rows[i], size=bigger)
    elif corruption is Corruption.UNDECODABLE:
        for n, i in enumerate(sorted(_some(rng, range(count), 0.01, at_least=3))):
            rows[i] = replace(rows[i], damage=("truncated", "error-page")[n % 2])
    elif corruption is Corruption.LEAKAGE:
        _leak(rng, rows, drawn)
    return rows


def _classes(rng: np.random.Generator, count: int, *, skewed: bool) -> list[str]:
    if skewed:
        minority = max(1, round(0.05 * count))
        counts = [count - minority * (len(LABELS) - 1)] + [minority] * (len(LABELS) - 1)
    else:
        counts = [count // len(LABELS) + (k < count % len(LABELS)) for k in range(len(LABELS))]
    ordered = [label for label, n in zip(LABELS, counts, strict=True) for _ in range(n)]
    return [ordered[i] for i in rng.permutation(count)]


def _splits(rng: np.random.Generator, drawn: list[str]) -> list[str]:
    """~70/15/15 within each class, so every split sees every class in proportion."""
    splits = [""] * len(drawn)
    for label in LABELS:
        members = [int(i) for i in rng.permutation([i for i, c in enumerate(drawn) if c == label])]
        n_test = round(0.15 * len(members)) or int(len(members) >= 2)  # leakage needs a test row per class
        n_val = round(0.15 * len(members))
        n_train = len(members) - n_val - n_test
        for rank, i in enumerate(members):
            splits[i] = "train" if rank < n_train else "val" if rank < n_train + n_val else "test"
    return splits


def _some(rng: np.random.Generator, pool: range | list[int], fraction: float, at_least: int) -> list[int]:
    k = min(len(pool), max(at_least, round(fraction * len(pool))))
    return [int(i) for i in rng.choice(list(pool), size=k, replace=False)]


def _per_class(rng: np.random.Generator, drawn: list[str], fraction: float) -> list[int]:
    """The same share of every class (at least one each), so the remaining labels stay balanced."""
    chosen: list[int] = []
    for label in LABELS:
        members = [i for i, c in enumerate(drawn) if c == label]
        chosen += _some(rng, members, fraction, at_least=1) if members else []
    return chosen


def _leak(rng: np.random.Generator, rows: list[_Row], drawn: list[str]) -> None:
    """Turn some test rows into byte-copies of train images of the same class (labels stay as they are)."""
    test = [i for i, row in enumerate(rows) if row.split == "test"]
    for i in _some(rng, test, 0.2, at_least=3):
        train = [j for j, row in enumerate(rows) if row.split == "train" and drawn[j] == drawn[i]]
        if train:
            rows[i] = replace(rows[i], source=int(rng.choice(train)))


def _encode(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    # Level 1: noisy pixels gain little from harder work (8.0 KB here vs 7.2 KB at the default level 6)
    # and encoding is most of the time per image after rendering.
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _damage(data: bytes, how: str, index: int) -> bytes:
    if how == "truncated":  # an upload cut short: a valid header, then the pixel data stops
        return data[: len(data) // 3]
    # What a failed download saves under the image's name; the key makes each page (and sha256) unique.
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message>'
        f"<Key>images/{index:05d}.png</Key></Error>\n"
    ).encode()


def _label_order(label: str) -> tuple[int, str]:
    return (LABELS.index(label), "") if label in LABELS else (len(LABELS), label)
