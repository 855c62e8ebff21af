"""The labelled splits of a dataset version as model inputs: the manifest rows of a split that have a
label, their images read in parallel and decoded (undecodable ones skipped, the data gate reports them),
and preprocessed by ``serving.preprocessing.preprocess``, the code the model server runs.

Training loads its train and val splits with ``load_split``; the evaluation gate reads the test split's
rows and images with ``labelled_rows`` and ``decode_or_none``.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from serving.preprocessing import PreprocessSpec, preprocess
from sluicegate.errors import DatasetError
from tasks.dataset_source import DatasetSource, map_objects
from tasks.image_stats import decode_rgb

log = logging.getLogger(__name__)

T = TypeVar("T")

# Decoded images preprocessed at once: bounds the uint8 images held besides the float32 output.
PREPROCESS_CHUNK = 256


def load_split(
    source: DatasetSource,
    manifest: bytes,
    split: str,
    spec: PreprocessSpec,
    labels: Sequence[str] | None,
    *,
    concurrency: int = 16,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], tuple[str, ...]]:
    """The labelled rows of one split, decoded and preprocessed with ``spec``.

    Args:
        source: where the images are.
        manifest: the dataset version's manifest.csv bytes.
        split: "train", "val" or "test".
        spec: the candidate model's preprocessing.
        labels: class index -> label (the training split's labels when loading val/test); None: the
            sorted labels of this split.
        concurrency: objects read and decoded in parallel.

    Returns:
        ``(X, y, labels)``: float32 ``(N, C, H, W)`` (C: the spec's channels), int64 ``(N,)`` and the
        labels ``y`` indexes. Rows with an empty label, and images that are missing or do not decode,
        are skipped (the data gate reports those).

    Raises:
        DatasetError: the manifest cannot be read, the split has no usable rows, or a row's label is not
            in ``labels`` (a model cannot be scored on a class it does not have).
    """
    rows = labelled_rows(manifest, split)
    if not rows:
        raise DatasetError(f"manifest.csv has no rows with split {split!r} and a label; nothing to load")
    names = tuple(sorted({label for _, label in rows})) if labels is None else tuple(labels)
    index = {label: i for i, label in enumerate(names)}
    unknown = sorted({label for _, label in rows} - set(index))
    if unknown:
        raise DatasetError(
            f"split {split!r} has label(s) {unknown} that are not among the model's labels {list(names)}; "
            "relabel those rows or train on a dataset that has them"
        )
    chunks, targets, skipped = _read_preprocessed(source, rows, index, spec, concurrency)
    if skipped:
        log.warning("split %s: skipped %d of %d images that are missing or undecodable", split, skipped, len(rows))
    if not chunks:
        raise DatasetError(f"split {split!r}: none of its {len(rows)} images could be read and decoded")
    return np.concatenate(chunks), np.asarray(targets, dtype=np.int64), names


def _read_preprocessed(
    source: DatasetSource,
    rows: Sequence[tuple[str, str]],
    index: Mapping[str, int],
    spec: PreprocessSpec,
    concurrency: int,
) -> tuple[list[npt.NDArray[np.float32]], list[int], int]:
    """The images of ``rows`` (path, label) decoded and preprocessed ``PREPROCESS_CHUNK`` at a time, the
    class index of each, and how many were skipped as missing or undecodable."""
    label_of = dict(rows)
    chunks: list[npt.NDArray[np.float32]] = []
    targets: list[int] = []
    pending: list[npt.NDArray[np.uint8]] = []
    skipped = 0
    for path, outcome in map_objects(source, [path for path, _ in rows], decode_or_none, concurrency):
        if not isinstance(outcome, np.ndarray):
            skipped += 1
            continue
        pending.append(outcome)
        targets.append(index[label_of[path]])
        if len(pending) == PREPROCESS_CHUNK:
            chunks.append(preprocess(pending, spec))
            pending = []
    if pending:
        chunks.append(preprocess(pending, spec))
    return chunks, targets, skipped


def labelled_rows(manifest: bytes, split: str) -> list[tuple[str, str]]:
    """(path, label) of the manifest rows of ``split`` that have a label."""
    try:
        text = manifest.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"manifest.csv is not UTF-8 text: {exc}") from exc
    reader = csv.DictReader(io.StringIO(text), skipinitialspace=True)
    if not {"path", "label", "split"} <= {name.strip() for name in reader.fieldnames or []}:
        raise DatasetError("manifest.csv lacks a column; its header must be 'path,label,split'")
    rows = []
    for raw in reader:
        row = {key.strip(): (value or "").strip() for key, value in raw.items() if key is not None}
        if row["split"] == split and row["label"] and row["path"]:
            rows.append((row["path"], row["label"]))
    return rows


def decode_or_none(_: str, data: bytes) -> npt.NDArray[np.uint8] | None:
    """RGB uint8 pixels, or None for bytes that are not a decodable image (the data gate reports those)."""
    try:
        return decode_rgb(data)
    except (OSError, ValueError, SyntaxError):
        return None


def read_labelled(
    source: DatasetSource,
    manifest: bytes,
    split: str,
    decode: Callable[[str, bytes], T | None],
    *,
    limit: int,
    seed: int = 0,
    concurrency: int = 16,
    reader: str = "this stage",
) -> tuple[list[T], list[str]]:
    """A split's labelled images as ``decode`` makes them (read in parallel; None: skipped, the data gate
    reports those), with their labels; at most ``limit`` rows, a seeded subset beyond, the same every run.

    Args:
        reader: who needs the rows, for the error message ("the evaluation gate").

    Raises:
        DatasetError: the split has no labelled rows or none of its images decode.
    """
    rows = labelled_rows(manifest, split)
    if not rows:
        raise DatasetError(f"manifest.csv has no labelled rows with split {split!r}: {reader} needs some")
    if len(rows) > limit:
        keep = np.sort(np.random.default_rng(seed).choice(len(rows), size=limit, replace=False))
        rows = [rows[i] for i in keep]
    label_of = dict(rows)
    images: list[T] = []
    labels: list[str] = []
    for path, outcome in map_objects(source, [path for path, _ in rows], decode, concurrency):
        if outcome is not None and not isinstance(outcome, DatasetError):
            images.append(outcome)
            labels.append(label_of[path])
    if not images:
        raise DatasetError(f"none of the {len(rows)} {split} images could be read and decoded")
    return images, labels
