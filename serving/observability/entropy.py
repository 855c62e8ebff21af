"""Output entropy: how sure the model is of each answer, and whether its answers have collapsed.

A collapsed model answers (nearly) the same thing whatever it is shown: a broken engine, a wrong input
layout, weights that diverged. Its answers then stop varying: the entropy of the softmax is the same for
every row, and the predicted class is the same too.

The rule (``EntropyMonitor``), over the last ``window`` rows, once ``min_rows`` are in:

1. ``std(entropy) <= collapse_std_bits`` (0.05 bits, DESIGN's canary bound): every answer is equally
   sure. That is healthy in one case only, a confident classifier (mean entropy under ``sure_bits``,
   0.25) whose answers name different classes; so the window is a collapse unless its mean entropy is
   under ``sure_bits`` **and** no class holds ``collapse_class_share`` (0.95) of the rows. The std
   alone would flag every confident model; the class share alone would miss a collapse to the
   uniform answer, whose argmax is noise.
2. Only when the expected mean entropy is known (``expected_bits``, e.g. measured on the validation
   set): ``mean(entropy) < drop_fraction * expected_bits``, the model became far surer than it was.

Answers of the rules runtime are one fixed class by design; do not feed them to the monitor.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def softmax(logits: npt.ArrayLike) -> FloatArray:
    """Row-wise softmax of ``(N, C)`` logits, in float64, stable for large logits."""
    array = np.asarray(logits, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] < 1:
        raise ValueError(f"logits must be (rows, classes), got shape {array.shape}")
    shifted = np.exp(array - array.max(axis=1, keepdims=True))
    probabilities: FloatArray = shifted / shifted.sum(axis=1, keepdims=True)
    return probabilities


def entropy_bits(probabilities: FloatArray) -> FloatArray:
    """Shannon entropy of each row, in bits (0: one-hot; log2(C): uniform)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probabilities > 0, probabilities * np.log2(probabilities), 0.0)
    bits: FloatArray = np.maximum(-terms.sum(axis=1), 0.0)  # -0.0 and rounding below zero -> 0
    return bits


@dataclass(frozen=True)
class OutputSummary:
    """One request's answers, for the metrics and the request log."""

    entropy_bits: FloatArray  # (N,)
    confidence: FloatArray  # (N,) top softmax probability of each row
    predicted: npt.NDArray[np.intp]  # (N,) argmax
    collapsed: bool  # the monitor's verdict after these rows

    @property
    def min_confidence(self) -> float:
        """The least sure row: the request log's ``output_confidence`` (NaN if a row had no answer)."""
        return float(self.confidence.min())


@dataclass(frozen=True)
class EntropyWindow:
    rows: int
    mean_bits: float
    std_bits: float
    top_class_share: float
    collapsed: bool


class EntropyMonitor:
    """A sliding window of per-row output entropies and predicted classes, and the collapse rule above.

    Thread-safe: ``observe`` is called from request threads; it holds a lock while it copies the rows
    in and recomputes the window's mean, std and class share (a few microseconds for 500 rows).

    Args:
        window: Rows kept.
        min_rows: Rows needed before the rule is applied (fewer say nothing).
        collapse_std_bits: Rule 1's bound on the entropy std.
        collapse_class_share: Rule 1: a sure window where one class holds this share is a collapse.
        sure_bits: Rule 1: mean entropy under which a window counts as sure.
        expected_bits: Mean entropy the model normally has; None (default) disables rule 2.
        drop_fraction: Rule 2's fraction of ``expected_bits``.
    """

    def __init__(
        self,
        window: int = 500,
        *,
        min_rows: int = 100,
        collapse_std_bits: float = 0.05,
        collapse_class_share: float = 0.95,
        sure_bits: float = 0.25,
        expected_bits: float | None = None,
        drop_fraction: float = 0.5,
    ) -> None:
        if window < 1 or min_rows < 1:
            raise ValueError(f"window and min_rows must be >= 1, got {window} and {min_rows}")
        if not 0 < collapse_class_share <= 1:
            raise ValueError(f"collapse_class_share must be in (0, 1], got {collapse_class_share}")
        self._window = window
        self._min_rows = min(min_rows, window)
        self._std_bits = collapse_std_bits
        self._class_share = collapse_class_share
        self._sure_bits = sure_bits
        self._expected = expected_bits
        self._drop = drop_fraction
        self._lock = threading.Lock()
        self._bits = np.zeros(window, dtype=np.float64)
        self._classes = np.zeros(window, dtype=np.intp)
        self._head = self._filled = 0
        self._state = EntropyWindow(0, 0.0, 0.0, 0.0, False)

    @property
    def collapsed(self) -> bool:
        return self._state.collapsed

    @property
    def state(self) -> EntropyWindow:
        return self._state

    def observe(self, logits: npt.ArrayLike) -> OutputSummary:
        """Add one request's ``(N, C)`` logits; rows with non-finite logits are returned but not kept.

        Raises:
            ValueError: ``logits`` is not 2-D.
        """
        probabilities = softmax(logits)
        bits = entropy_bits(probabilities)
        confidence = probabilities.max(axis=1)
        predicted = probabilities.argmax(axis=1)
        finite = np.isfinite(probabilities).all(axis=1)
        if finite.all():
            kept_bits, kept_classes = bits, predicted
        else:  # NaN or infinite logits: no entropy to speak of
            bits[~finite] = confidence[~finite] = np.nan
            kept_bits, kept_classes = bits[finite], predicted[finite]
        with self._lock:
            self._add(kept_bits, kept_classes)
            state = self._evaluate()
            self._state = state
        return OutputSummary(bits, confidence, predicted, state.collapsed)

    def _add(self, bits: FloatArray, classes: npt.NDArray[np.intp]) -> None:
        count = bits.size
        if count >= self._window:
            self._bits[:] = bits[-self._window :]
            self._classes[:] = classes[-self._window :]
            self._head, self._filled = 0, self._window
            return
        slots = (self._head + np.arange(count)) % self._window
        self._bits[slots] = bits
        self._classes[slots] = classes
        self._head = (self._head + count) % self._window
        self._filled = min(self._window, self._filled + count)

    def _evaluate(self) -> EntropyWindow:
        rows = self._filled
        if rows == 0:
            return EntropyWindow(0, 0.0, 0.0, 0.0, False)
        bits, classes = self._bits[:rows], self._classes[:rows]
        mean, std = float(bits.mean()), float(bits.std())
        share = float(np.bincount(classes).max()) / rows
        varied_and_sure = mean < self._sure_bits and share < self._class_share
        collapsed = rows >= self._min_rows and (
            (std <= self._std_bits and not varied_and_sure)
            or (self._expected is not None and mean < self._drop * self._expected)
        )
        return EntropyWindow(rows, mean, std, share, collapsed)
