"""The synthetic sample: deterministic, clean by default, each corruption trips exactly its own check,
and the classes are learnable from the joints but not from colour."""

from __future__ import annotations

import csv
import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sluicegate.errors import DatasetError
from tasks.sample_data import LABELS, Corruption, SampleSummary, make_sample

try:
    from scipy.stats import entropy
except ImportError:  # the KL divergence by hand, same definition
    entropy = None


@dataclass(frozen=True)
class Facts:
    """What the data gate would measure, computed here from the files alone."""

    rows: list[dict[str, str]]
    pixels: dict[str, np.ndarray]  # decodable images only
    undecodable: int
    sha_mismatches: int

    def column(self, name: str) -> list[str]:
        return [row[name] for row in self.rows]

    @property
    def missing_fraction(self) -> float:
        return sum(not label for label in self.column("label")) / len(self.rows)

    @property
    def known(self) -> Counter[str]:
        return Counter(label for label in self.column("label") if label in LABELS)

    @property
    def unknown_labels(self) -> set[str]:
        return {label for label in self.column("label") if label and label not in LABELS}

    @property
    def kl_vs_uniform(self) -> float:
        p = np.array([self.known[label] for label in LABELS], float) / sum(self.known.values())
        q = np.full(len(LABELS), 1 / len(LABELS))
        if entropy is not None:
            return float(entropy(p, q))
        return float(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0))

    @property
    def other_size_fraction(self) -> float:
        sizes = Counter(array.shape for array in self.pixels.values())
        return 1 - sizes.most_common(1)[0][1] / len(self.pixels)

    @property
    def leaked(self) -> set[str]:
        by_split = {split: {row["sha256"] for row in self.rows if row["split"] == split} for split in ("train", "test")}
        return by_split["train"] & by_split["test"]

    def split_fractions(self) -> dict[str, float]:
        counts = Counter(self.column("split"))
        return {split: counts[split] / len(self.rows) for split in ("train", "val", "test")}


def facts(directory: Path) -> Facts:
    with (directory / "manifest.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    pixels, undecodable, mismatches = {}, 0, 0
    for row in rows:
        data = (directory / row["path"]).read_bytes()
        mismatches += hashlib.sha256(data).hexdigest() != row["sha256"]
        try:
            with Image.open(directory / row["path"]) as image:
                assert image.mode == "RGB"
                pixels[row["path"]] = np.asarray(image.convert("RGB"))
        except (OSError, SyntaxError):
            undecodable += 1
    return Facts(rows, pixels, undecodable, mismatches)


def assert_clean_except(found: Facts, tripped: str) -> None:
    """Every data check passes, apart from the one named, whose defect must be there."""
    checks = {
        "missing": (found.missing_fraction > 0.05, found.missing_fraction == 0),
        "skew": (found.kl_vs_uniform > 0.3, found.kl_vs_uniform < 0.01),
        "sizes": (found.other_size_fraction > 0.01, found.other_size_fraction == 0),
        "decode": (found.undecodable >= 3, found.undecodable == 0),
        "leakage": (len(found.leaked) >= 1, not found.leaked),
        "unknown": (bool(found.unknown_labels), not found.unknown_labels),
    }
    for name, (defective, clean) in checks.items():
        assert defective if name == tripped else clean, f"check {name!r}: {'no defect' if name == tripped else 'dirty'}"
    assert found.sha_mismatches == 0
    fractions = found.split_fractions()
    assert fractions["train"] == pytest.approx(0.70, abs=0.04)
    assert fractions["val"] == pytest.approx(0.15, abs=0.04) and fractions["test"] == pytest.approx(0.15, abs=0.04)
    if tripped != "skew":  # balanced over the rows that carry a known label
        share = sum(found.known.values()) / len(LABELS)
        assert all(abs(found.known[label] - share) <= 0.1 * share for label in LABELS), found.known


@pytest.fixture(scope="module")
def default_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleSummary, Facts]:
    summary = make_sample(tmp_path_factory.mktemp("default") / "v1", count=400, seed=0)
    return summary, facts(summary.directory)


def test_same_seed_writes_the_same_bytes(tmp_path: Path) -> None:
    seen: list[int] = []
    first = files(make_sample(tmp_path / "a", count=120, seed=7, on_image=seen.append).directory)
    again = files(make_sample(tmp_path / "b", count=120, seed=7).directory)
    other = files(make_sample(tmp_path / "c", count=120, seed=8).directory)
    assert seen == list(range(120))
    assert len(first) == 121 and first == again
    differing = [name for name, data in other.items() if first[name] != data]
    assert "manifest.csv" in differing and len(differing) > 100


def files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_default_sample_passes_every_check(default_sample: tuple[SampleSummary, Facts]) -> None:
    summary, found = default_sample
    assert_clean_except(found, tripped="")
    assert len(found.pixels) == 400
    assert {array.shape for array in found.pixels.values()} == {(64, 64, 3)}
    assert found.column("path")[:2] == ["images/00000.png", "images/00001.png"]
    assert summary.labels == dict(Counter(found.column("label"))) and set(summary.labels) == set(LABELS)
    assert summary.splits == dict(Counter(found.column("split")))
    assert (summary.count, summary.seed, summary.image_size, summary.corruption) == (400, 0, (64, 64), None)


@pytest.mark.parametrize(
    ("corruption", "tripped"),
    [
        (Corruption.MISSING_LABELS, "missing"),
        (Corruption.SKEWED_LABELS, "skew"),
        (Corruption.MIXED_SIZES, "sizes"),
        (Corruption.UNDECODABLE, "decode"),
        (Corruption.LEAKAGE, "leakage"),
        (Corruption.UNKNOWN_LABELS, "unknown"),
    ],
)
def test_each_corruption_plants_only_its_defect(tmp_path: Path, corruption: Corruption, tripped: str) -> None:
    summary = make_sample(tmp_path / "v1", count=200, seed=3, corrupt=corruption)
    assert summary.corruption is corruption and summary.count == 200
    assert_clean_except(facts(tmp_path / "v1"), tripped)


def test_corruption_accepts_the_cli_spelling(tmp_path: Path) -> None:
    summary = make_sample(tmp_path / "v1", count=8, corrupt="leakage")  # type: ignore[arg-type]
    assert summary.corruption is Corruption.LEAKAGE
    assert len(facts(tmp_path / "v1").leaked) == 3  # even the smallest sample leaks three test images


def _upright(gray: np.ndarray) -> np.ndarray:
    """Turn each image so its darkest border strip (the IC package) is on top, then fold left onto right.

    The camera may see the joints at any quarter turn; a linear model on raw pixels would have to learn
    each turn separately from a few hundred images.
    """
    k = gray.shape[1] // 4
    top, right, bottom, left = (gray[:, :k], gray[:, :, -k:], gray[:, -k:], gray[:, :, :k])
    strips = np.stack([strip.mean(axis=(1, 2)) for strip in (top, right, bottom, left)], axis=1)
    turned = np.stack([np.rot90(image, turn) for image, turn in zip(gray, strips.argmin(axis=1), strict=True)])
    folded: np.ndarray = (turned + turned[:, :, ::-1]) / 2
    return folded


def _accuracy(features: np.ndarray, labels: np.ndarray, train: np.ndarray) -> dict[str, float]:
    """Held-out accuracy of a nearest-centroid and a ridge (least-squares one-vs-rest) linear classifier."""
    x = features
    centroids = np.stack([x[train & (labels == k)].mean(0) for k in range(len(LABELS))])
    nearest = ((x[~train, None] - centroids[None]) ** 2).sum(-1).argmin(1)
    design = np.hstack([x, np.ones((len(x), 1))])
    gram = design[train].T @ design[train] + 100 * np.eye(design.shape[1])
    weights = np.linalg.solve(gram, design[train].T @ np.eye(len(LABELS))[labels[train]])
    ridge = (design[~train] @ weights).argmax(1)
    return {"centroid": float((nearest == labels[~train]).mean()), "ridge": float((ridge == labels[~train]).mean())}


def test_classes_are_learnable_from_the_joints_not_from_colour(default_sample: tuple[SampleSummary, Facts]) -> None:
    _, found = default_sample
    images = np.stack([found.pixels[path] for path in found.column("path")]).astype(np.float32)
    labels = np.array([LABELS.index(label) for label in found.column("label")])
    train = np.array([split == "train" for split in found.column("split")])

    gray = (images @ np.array([0.299, 0.587, 0.114], np.float32)).reshape(-1, 16, 4, 16, 4).mean(axis=(2, 4))
    gray = (gray - gray.mean(axis=(1, 2), keepdims=True)) / gray.std(axis=(1, 2), keepdims=True)
    shape = _accuracy(_upright(gray).reshape(len(gray), -1), labels, train)
    colour = _accuracy(images.mean(axis=(1, 2)), labels, train)

    assert shape["centroid"] > 0.5 and shape["ridge"] > 0.6, shape
    assert colour["centroid"] < 0.45 and colour["ridge"] < 0.45, colour


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"count": 7}, "count=7"),
        ({"seed": -1}, "seed=-1"),
        ({"image_size": (15, 64)}, r"image_size=\(15, 64\)"),
        ({"corrupt": "smudged"}, r"corrupt='smudged'.*missing-labels"),
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, arguments: dict[str, object], named: str) -> None:
    with pytest.raises(DatasetError, match=named):
        make_sample(tmp_path / "v1", **arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "v1").exists()


def test_refuses_a_folder_that_holds_files(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "notes.txt").write_text("keep me")
    with pytest.raises(DatasetError, match=r"directory .*v1.* is not empty"):
        make_sample(tmp_path / "v1", count=8)
    assert [path.name for path in (tmp_path / "v1").iterdir()] == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    make_sample(tmp_path / "empty", count=8)  # an existing empty folder is fine
