"""Real image sets nobody here made, written as dataset versions that follow the contract.

scikit-learn ships the UCI handwritten digits (1,797 scans of 8x8 pixels, 16 grey levels, 10 classes,
from 43 writers) inside its wheel, so they need no download: a second, real dataset for the demo, the
tests and the benchmarks, next to our synthetic PCB sample. Images are written grey (PNG mode "L"),
upscaled bilinearly to ``size`` (as a scanner would deliver them), with a seeded, stratified
70/15/15 split.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sluicegate.errors import DatasetError
from tasks.datasets import MANIFEST

SPLIT_FRACTIONS = (("train", 0.70), ("val", 0.15), ("test", 0.15))


@dataclass(frozen=True)
class RealDataset:
    directory: Path
    name: str
    size: int
    labels: dict[str, int]
    splits: dict[str, int]


def digits_pixels(classes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The digits as uint8 (N, 8, 8) grey images (0..16 scaled to 0..255) and int labels; only
    ``classes`` when given."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    targets = bunch.target.astype(np.int64)
    if classes is not None:
        keep = np.isin(targets, list(classes))
        images, targets = images[keep], targets[keep]
    return images, targets


def stratified_splits(targets: np.ndarray, seed: int) -> list[str]:
    """A split per row: within each class, a seeded shuffle cut at 70/15/15 (every class in every split)."""
    rng = np.random.default_rng(seed)
    splits = [""] * len(targets)
    for label in np.unique(targets):
        rows = rng.permutation(np.flatnonzero(targets == label))
        train_end = round(len(rows) * SPLIT_FRACTIONS[0][1])
        val_end = train_end + round(len(rows) * SPLIT_FRACTIONS[1][1])
        for position, row in enumerate(rows):
            splits[row] = "train" if position < train_end else "val" if position < val_end else "test"
    return splits


def write_digits(
    directory: Path, *, size: int = 64, classes: Sequence[int] | None = None, seed: int = 0
) -> RealDataset:
    """Write the digits (or only ``classes``) to ``directory`` (absent or empty) as grey PNGs + manifest.

    Raises:
        DatasetError: a bad size or class, or a folder that holds files already.
    """
    from PIL import Image

    if not 8 <= size <= 512:
        raise DatasetError(f"--size {size} is out of range: use 8..512 pixels (the scans are 8x8)")
    if classes is not None and (len(set(classes)) < 2 or not set(classes) <= set(range(10))):
        raise DatasetError(f"--classes {list(classes)}: name at least two distinct digits from 0 to 9")
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise DatasetError(f"{directory} is not empty; write a dataset version into a new or empty folder")
    images, targets = digits_pixels(classes)
    splits = stratified_splits(targets, seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["path", "label", "split", "sha256"])
    for index, (pixels, target, split) in enumerate(zip(images, targets, splits, strict=True)):
        picture = Image.fromarray(pixels, "L").resize((size, size), Image.Resampling.BILINEAR)
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        data = buffer.getvalue()
        path = f"images/{index:05d}.png"
        (directory / path).write_bytes(data)
        writer.writerow([path, str(int(target)), split, hashlib.sha256(data).hexdigest()])
    # The manifest goes last, as in an upload: a folder without one was never finished.
    (directory / MANIFEST).write_text(out.getvalue(), encoding="utf-8", newline="")
    counts = Counter(str(int(t)) for t in targets)
    return RealDataset(
        directory=directory,
        name="digits" if classes is None else "digits-" + "-".join(str(c) for c in sorted(classes)),
        size=size,
        labels={label: counts[label] for label in sorted(counts)},
        splits={split: splits.count(split) for split, _ in SPLIT_FRACTIONS},
    )
