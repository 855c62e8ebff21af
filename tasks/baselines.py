"""Gate 5's baselines: what a model must beat to be worth serving at all.

Two reference classifiers fit on the dataset version's train split and scored on the same test images
as the candidate: the majority class (always predict the train split's most common label) and a linear
probe (scikit-learn logistic regression on the pixels downsampled to ``size`` x ``size``). A network
that a linear model on 16x16 thumbnails beats has learnt nothing the pixels did not already give away,
so the eval gate fails it (``baseline_checks``), first model or not.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sluicegate.settings import EvalGateSettings
from tasks.dataset_source import DatasetSource
from tasks.evaluation import Evaluation
from tasks.verdicts import Check, GateVerdict

Image = npt.NDArray[np.uint8]

# Train images the linear baseline is fit on at most (a seeded subset beyond): 20,000 thumbnails of
# 16x16x3 are 15 MB of features and an L-BFGS fit of well under a minute on a few cores, while the
# baseline's accuracy has long stopped moving with more data at that size.
MAX_TRAIN_IMAGES = 20_000
# L-BFGS iterations: standardised pixels of a real dataset converge in tens to a few hundred; the
# ceiling only bounds a pathological fit, which is then reported (``linear_converged``) rather than
# raised: an unconverged probe scores lower, so it makes the rule laxer, never wrongly stricter.
MAX_ITER = 1000
# Accuracies are ratios of counts; an exact tie with ``baseline + margin`` must not fail by one ulp.
_EPS = 1e-9


@dataclass(frozen=True)
class Baselines:
    """The two reference accuracies on the test split and how they were obtained."""

    majority_accuracy: float
    majority_label: str  # the train split's most common label (ties: the first in ``labels`` order)
    linear_accuracy: float
    linear_seconds: float  # fit + predict wall time of the linear baseline
    train_count: int  # train images the baselines were fit on (after the cap)
    test_count: int
    size: int  # thumbnail side of the linear baseline's features
    grey: bool  # features were one grey channel (every image had R == G == B) instead of RGB
    linear_converged: bool = True  # False: L-BFGS stopped at MAX_ITER (or one class: no fit needed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self) -> dict[str, object]:
        """Flat figures for the gate's verdict metrics and MLflow (one name per figure in both)."""
        return {
            "baseline_majority_accuracy": self.majority_accuracy,
            "baseline_majority_label": self.majority_label,
            "baseline_linear_accuracy": self.linear_accuracy,
            "baseline_linear_seconds": self.linear_seconds,
            "baseline_train_images": self.train_count,
            "baseline_size": self.size,
            "baseline_grey": self.grey,
        }


def baselines(
    train_images: Sequence[Image],
    train_labels: Sequence[str],
    test_images: Sequence[Image],
    test_labels: Sequence[str],
    labels: Sequence[str],
    *,
    size: int,
    seed: int = 0,
    max_train: int = MAX_TRAIN_IMAGES,
) -> Baselines:
    """Fit the majority-class and linear baselines on the train images and score them on the test images.

    Args:
        train_images: uint8 RGB ``(H, W, 3)`` images as ``tasks.image_stats.decode_rgb`` returns them
            (sizes may differ).
        train_labels: the label of each train image.
        test_images: the images the candidate is scored on, same format.
        test_labels: their labels (ones absent from the train split simply count as errors).
        labels: the class order: it breaks majority ties, so the result does not depend on row order.
        size: thumbnail side the linear baseline downsamples every image to.
        seed: picks the train subset beyond ``max_train`` and seeds the solver.
        max_train: most train images used.

    Returns:
        The two accuracies, the majority label, the fit's time and what it was fit on.

    Raises:
        ValueError: an empty split, or images and labels of different lengths.
    """
    for split, images, names in (("train", train_images, train_labels), ("test", test_images, test_labels)):
        if not images or len(images) != len(names):
            raise ValueError(
                f"{split}: need the same positive number of images and labels, got {len(images)}, {len(names)}"
            )
    train_images, train_labels = _capped(train_images, train_labels, max_train, seed)
    majority = majority_label(train_labels, labels)
    truth = np.asarray(test_labels)
    grey = all(is_grey(image) for image in (*train_images, *test_images))
    start = time.perf_counter()
    predicted, converged = _linear_predictions(
        features(train_images, size, grey), train_labels, features(test_images, size, grey), seed
    )
    return Baselines(
        majority_accuracy=float(np.mean(truth == majority)),
        majority_label=majority,
        linear_accuracy=float(np.mean(predicted == truth)),
        linear_seconds=time.perf_counter() - start,
        train_count=len(train_images),
        test_count=len(test_images),
        size=size,
        grey=grey,
        linear_converged=converged,
    )


def _capped(
    images: Sequence[Image], names: Sequence[str], limit: int, seed: int
) -> tuple[Sequence[Image], Sequence[str]]:
    if len(images) <= limit:
        return images, names
    keep = np.sort(np.random.default_rng(seed).choice(len(images), size=limit, replace=False))
    return [images[i] for i in keep], [names[i] for i in keep]


def majority_label(train_labels: Sequence[str], labels: Sequence[str]) -> str:
    """The most common train label; ties go to the first in ``labels`` order (then alphabetical)."""
    counts = Counter(train_labels)
    order = {label: i for i, label in enumerate(labels)}
    return min(counts, key=lambda label: (-counts[label], order.get(label, len(order)), label))


def is_grey(image: Image) -> bool:
    """True when R == G == B at every pixel (a grey image decoded to RGB)."""
    return bool(np.array_equal(image[..., 0], image[..., 1]) and np.array_equal(image[..., 1], image[..., 2]))


def thumbnail(image: Image, size: int) -> Image:
    """``size`` x ``size`` uint8 RGB by PIL's bilinear filter.

    PIL rather than ``serving.preprocessing.resize_bilinear``: PIL widens its filter when shrinking
    (antialiasing), so a 224-pixel image becomes a 16-pixel average of its content; torch-style
    bilinear would sample 2x2 pixels of every 14x14 block, which aliases and weakens the baseline.
    Every band is filtered alike, so a grey image stays exactly grey.
    """
    from PIL import Image as PILImage

    if image.shape[:2] == (size, size):
        return image
    return np.asarray(PILImage.fromarray(image).resize((size, size), PILImage.Resampling.BILINEAR), dtype=np.uint8)


def features(images: Sequence[Image], size: int, grey: bool) -> npt.NDArray[np.float32]:
    """Flattened thumbnails scaled to [0, 1]: ``(N, size * size)`` grey or ``(N, size * size * 3)`` RGB."""
    stack = np.stack([thumbnail(image, size) for image in images])
    if grey:
        stack = stack[..., :1]  # the three channels are equal: one carries all there is
    return (stack.reshape(len(images), -1) / np.float32(255)).astype(np.float32)


def _linear_predictions(
    x_train: npt.NDArray[np.float32], y_train: Sequence[str], x_test: npt.NDArray[np.float32], seed: int
) -> tuple[npt.NDArray[Any], bool]:
    """Test predictions of standardised logistic regression, and whether L-BFGS converged."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    classes = sorted(set(y_train))
    if len(classes) == 1:  # logistic regression needs two classes; with one, the only answer is that one
        return np.full(len(x_test), classes[0]), True
    # lbfgs is deterministic for given data; random_state only matters to solvers that shuffle.
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=MAX_ITER, random_state=seed))
    # One BLAS thread: the same sums in the same order on every machine (so the same accuracy), and on a
    # busy host OpenBLAS's spinning threads made this small fit tens of times slower than one thread.
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # reported as ``linear_converged`` instead
        model.fit(x_train, np.asarray(y_train))
        predicted = model.predict(x_test)
    converged = bool(np.all(model[-1].n_iter_ < MAX_ITER))
    return predicted, converged


def baseline_checks(candidate: Evaluation, found: Baselines, margin: float) -> list[Check]:
    """ "beats majority class" and "beats linear baseline": accuracy >= min(1, baseline + margin).

    The cap at 1: a baseline that is already perfect can be matched but not beaten, and a candidate that
    also scores 1.0 is as good as anything can be on this test split.
    """
    checks = []
    for name, what, accuracy in (
        ("beats majority class", f"majority class {found.majority_label!r}", found.majority_accuracy),
        ("beats linear baseline", f"logistic regression on {_describe(found)}", found.linear_accuracy),
    ):
        required = min(1.0, accuracy + margin)
        checks.append(
            Check(
                name,
                round(candidate.accuracy, 6),
                f">= {required:.4f} ({what} {accuracy:.4f} + {margin:g}, capped at 1)",
                candidate.accuracy + _EPS >= required,
            )
        )
    return checks


def _describe(found: Baselines) -> str:
    return f"{found.size}x{found.size} {'grey' if found.grey else 'RGB'} pixels"


def with_baselines(
    verdict: GateVerdict, candidate: Evaluation, found: Baselines, rules: EvalGateSettings
) -> GateVerdict:
    """The eval gate's verdict with the baseline checks appended and the baselines' figures in its metrics."""
    checks = (*verdict.checks, *baseline_checks(candidate, found, rules.baseline_margin))
    return GateVerdict(verdict.gate, checks, metrics={**verdict.metrics, **found.metrics()})


def load_split_thumbnails(
    source: DatasetSource,
    manifest: bytes,
    split: str,
    *,
    size: int,
    limit: int = MAX_TRAIN_IMAGES,
    seed: int = 0,
    concurrency: int = 16,
) -> tuple[list[Image], list[str]]:
    """A split's labelled images, read in parallel and shrunk to ``size`` x ``size`` RGB as they arrive.

    Shrinking in the reader keeps memory at ``limit`` thumbnails whatever the images' size (20,000
    full-size images would be gigabytes); ``baselines`` accepts the thumbnails as they are. At most
    ``limit`` rows are read, a seeded subset beyond, the same every run. Missing or undecodable images
    are skipped (the data gate reports them).

    Raises:
        DatasetError: the split has no labelled rows or none of its images decode.
    """
    from tasks.training_data import decode_or_none, read_labelled

    def shrink(path: str, data: bytes) -> Image | None:
        decoded = decode_or_none(path, data)
        return None if decoded is None else thumbnail(decoded, size)

    return read_labelled(
        source, manifest, split, shrink, limit=limit, seed=seed, concurrency=concurrency, reader="the baselines"
    )
