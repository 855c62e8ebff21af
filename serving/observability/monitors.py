"""The drift and output-entropy monitors of one model version, fed whole batches.

The batcher hands every successful batch's inputs and outputs to ``VersionMonitors.on_batch`` on its
worker thread, after the batch's callers have their answers. There it takes the batch's per-image plane
means (one BLAS call) while the images are still in the cache, if the drift monitor admits the batch
(``DriftMonitor.admit``: a window's worth of images per test interval, spread over it), and keeps only
those few floats per image and the logits; then it schedules one drain on the telemetry thread
(serving/observability/pipeline.py) if none is scheduled yet. Holding the images themselves until the
tick cost more than the arithmetic: a 50 ms tick of a busy small-model server held ~7 MB of them, long
out of the cache by then, and the same plane means took 22 us per 8-image batch instead of 8 us (and the
images' memory was not reused while hot). The drain takes every batch waiting, un-normalises the joined
means and computes the per-row entropies in a few numpy calls, then updates the monitors and their
metrics: the numpy call overhead (tens of microseconds per call on a small CPU, more than the arithmetic
on a few rows) is paid per drain, and the busier the server, the more batches one drain takes.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.observability.drift import ChannelSpec, DriftMonitor, channel_means, plane_means
from serving.observability.entropy import EntropyMonitor, softmax
from serving.observability.pipeline import TelemetryPipeline

Array = npt.NDArray[Any]

log = logging.getLogger(__name__)


class VersionMonitors:
    """Drift (when the version has a baseline and an image input) and entropy of one version.

    Args:
        model, version: The version, for the metrics' labels.
        metrics: The server's ``ServerMetrics``.
        pipeline: Where the work runs.
        entropy: The output-entropy monitor.
        logits: The output whose rows are softmaxed (the first declared output).
        drift: The drift monitor, or None.
        image_input: The NCHW input the drift features come from (with ``drift``).
        preprocessing: The version's preprocessing spec, to undo the normalisation for drift.
    """

    def __init__(
        self,
        model: str,
        version: str,
        metrics: Any,
        pipeline: TelemetryPipeline,
        *,
        entropy: EntropyMonitor,
        logits: str | None,
        drift: DriftMonitor | None = None,
        image_input: str | None = None,
        preprocessing: Mapping[str, Any] | None = None,
    ) -> None:
        self.model, self.version, self.metrics, self.pipeline = model, version, metrics, pipeline
        self.entropy, self.logits = entropy, logits
        self.drift: DriftMonitor | None = drift if image_input is not None else None
        self.image_input: str | None = image_input
        self.preprocessing = dict(preprocessing or {})
        # (plane means of the batch's images or None, the batch's outputs), per batch since the last drain
        self._waiting: list[tuple[Array | None, Mapping[str, Array]]] = []
        self._spec: ChannelSpec | None = None
        if self.drift is not None:
            try:
                self._spec = ChannelSpec.of(self.preprocessing)
            except ValueError as exc:  # config.json is checked at load; a spec this far off skips drift only
                log.warning("model %s version %s: no drift monitor: %s", model, version, exc)
                self.drift = None
        self._lock = threading.Lock()
        self._scheduled = False
        self.max_waiting = 256  # batches held for one drain; beyond it new ones are dropped (and counted)

    @property
    def abnormal(self) -> bool:
        """The version's answers are suspect now: its inputs drifted or its outputs collapsed."""
        return bool(self.entropy.collapsed or (self.drift is not None and self.drift.alarm))

    def on_batch(self, inputs: Mapping[str, Array], outputs: Mapping[str, Array]) -> None:
        """The batcher's ``on_outputs`` hook (worker thread): the batch's plane means, held with its
        outputs for the next drain."""
        planes = None
        drift, image = self.drift, inputs.get(self.image_input) if self.image_input is not None else None
        if drift is not None and self._spec is not None and image is not None and drift.admit(len(image)):
            planes = _planes(image, self._spec)
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                self.metrics.dropped("batch")
                return
            self._waiting.append((planes, outputs))
            if self._scheduled:
                return
            self._scheduled = True
        if not self.pipeline.submit("batch", self.drain):
            with self._lock:
                self._waiting.clear()
                self._scheduled = False

    def drain(self) -> None:
        """Feed every waiting batch to the monitors at once (telemetry thread)."""
        with self._lock:
            batches, self._waiting = self._waiting, []
            self._scheduled = False
        if not batches:
            return
        means = None
        if self._spec is not None:
            # The batches' plane means joined, then un-normalised once for the tick.
            present = [planes for planes, _ in batches if planes is not None]
            if present:
                means = self._spec.features(present[0] if len(present) == 1 else np.concatenate(present))
        logits = _stack([outputs.get(self.logits) for _, outputs in batches] if self.logits else [])
        self.observe_features(means, logits)

    def observe(self, inputs: Mapping[str, Array], outputs: Mapping[str, Array]) -> None:
        """Feed one batch to the monitors directly (tests; the server goes through ``on_batch``)."""
        means = None
        if self.drift is not None and self.image_input is not None and self.image_input in inputs:
            means = channel_means(inputs[self.image_input], self.preprocessing)
        logits = outputs.get(self.logits) if self.logits else None
        self.observe_features(means, None if logits is None else np.asarray(logits))

    def observe_features(self, means: Mapping[str, Array] | None, logits: Array | None) -> None:
        """Feed per-image channel means (feature -> values) and logits (rows x classes) to the monitors."""
        if self.drift is not None and means is not None:
            self.drift.observe(means)
        if logits is not None and logits.ndim == 2 and logits.shape[0]:
            summary = self.entropy.observe(logits)
            self.metrics.observe_entropy(self.model, self.version, summary.entropy_bits, summary.collapsed)


def _planes(batch: Any, spec: ChannelSpec) -> Array | None:
    """``plane_means`` of one batch's image input; None for a batch that is not NCHW (skipped, as
    before); a wrong channel count is refused as ``channel_means`` refuses it."""
    if np.ndim(batch) != 4:
        return None
    array = np.asarray(batch)
    if array.shape[1] != len(spec.names):
        raise ValueError(f"channel_means needs an (N, {len(spec.names)}, H, W) batch, got shape {array.shape}")
    return plane_means(array)


def _stack(arrays: list[Array | None]) -> Array | None:
    """The batches' rows in one array; None when any batch lacks the tensor or their shapes disagree."""
    present = [a for a in arrays if a is not None]
    if not present or len(present) != len(arrays):
        return None
    if len(present) == 1:
        return np.asarray(present[0])
    try:
        return np.concatenate(present)
    except ValueError:  # free non-batch dimensions that differ between batches: skip this drain
        return None


# Up to this many logits the confidence is computed on Python floats: numpy's per-call overhead (~12 us
# for a 1x4 softmax) was a tenth of a small model's request-log line, paid for every logged request.
_SMALL_LOGITS = 64


def min_confidence(logits: Array | None) -> float | None:
    """The request log's ``output_confidence``: the least sure row's top softmax probability."""
    if logits is None or np.ndim(logits) != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return None
    try:
        if logits.size <= _SMALL_LOGITS:
            small = _small_min_confidence(np.asarray(logits, dtype=np.float64).tolist())
            if small is not None:
                return small
        return float(softmax(logits).max(axis=1).min())
    except (TypeError, ValueError):
        return None


def _small_min_confidence(rows: list[list[float]]) -> float | None:
    """The same as softmax's top probability, per row, then the least: 1 / sum(exp(x - max)). None when
    a logit is not finite (the numpy path then gives what softmax gives)."""
    least = 1.0
    for row in rows:
        if not all(math.isfinite(value) for value in row):
            return None
        top = max(row)
        least = min(least, 1.0 / math.fsum(math.exp(value - top) for value in row))
    return least
