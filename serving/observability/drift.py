"""Feature drift: a sliding window of served per-image channel means, tested against the training set's.

The baseline is ``config.json``'s ``drift_baseline``, written by ``tasks.image_stats.channel_baseline``:
``{"r": [...], "g": [...], "b": [...]}``, one value per training image, each the mean of that channel
over the decoded uint8 RGB image, on the **0..255** scale. ``channel_means`` rebuilds the same values
from the normalised model input, so the two samples are comparable. A one-channel model (preprocessing
colour "L") sees only the grey channel, so it is watched on one feature, ``l``: the per-image mean luma
(ITU-R 601, as the preprocessing computes it), which ``baseline_features`` derives from the same r/g/b
baseline (the mean is linear: the luma of an image's channel means is the mean of its luma).

Thresholds and false alarms. An alarm needs both KS > ``ks_threshold`` (0.15, an effect size) and
p < ``p_threshold`` (0.01). The p-value alone would not do: 3 features tested every 100 images is
thousands of tests a day, and under no drift each has a 1% chance of p < 0.01, so a healthy stream would
alarm every few thousand images (the tests count this). The KS bound is what keeps it quiet: with a full
window (n = 1000) and a baseline of m images, a healthy stream exceeds D = 0.15 with probability about
``2 exp(-2 * 0.15**2 * n*m/(n+m))`` per feature per test: 1e-16 for m = 5000, 3e-10 for m = 1000,
6e-7 for m = 500. Below about m = 150 the p-value bound binds instead (D must pass ~0.17 at m = 100) and
chance alarms come back at ~1% per test: such a baseline is too small to watch drift with. Early windows
are the other weak spot (n = 100: ~1% per feature per test), so nothing is tested before
``min_samples`` images (default 300: 2e-5). A stream that shifts every image, as a dark camera does,
alarms at the first test at which more than 15% of a full window is new: 200 to 300 images after the
shift (tests are 100 apart), or at ``min_samples`` when it starts dark.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.preprocessing import LUMA_WEIGHTS, input_channels

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
CHANNELS = ("r", "g", "b")
GREY = "l"  # the one feature of a colour "L" (one grey channel) model: per-image mean luma
PIXEL_SCALE = 255.0  # channel_baseline's scale: means of uint8 pixel values


@dataclass(frozen=True)
class FeatureTest:
    statistic: float  # two-sample KS statistic D of the window against the baseline
    p_value: float


@dataclass(frozen=True)
class DriftReport:
    """The latest tests: ``features`` is empty until the first test has run."""

    features: Mapping[str, FeatureTest]
    alarm: bool
    window_size: int  # values per feature in the window when it was tested
    observed: int  # values observed since the monitor started

    def as_metrics(self) -> dict[str, tuple[float, float]]:
        """feature -> (statistic, p-value), the shape ``ServerMetrics.set_drift`` takes."""
        return {name: (test.statistic, test.p_value) for name, test in self.features.items()}


class DriftMonitor:
    """Sliding-window two-sample KS tests of served features against their training baseline.

    ``observe`` is called from many request threads; it copies a few floats into a ring buffer under a
    lock (tens of microseconds). Every ``test_every`` values a test is due: 3 KS tests of the window
    against the baseline (``ks_two_sample``, a few hundred microseconds together). With an
    ``executor`` they run there, so no request waits for them, and a test due while one is
    still running is skipped; without one they run inline, in the observing thread (tests).

    Args:
        baseline: Feature name -> the training sample (``drift_baseline``). Every feature needs at least
            one finite value.
        window: Most recent values kept per feature.
        test_every: Values between two tests.
        ks_threshold: KS statistic above which a feature has drifted (with ``p_threshold``).
        p_threshold: p-value below which the difference is not chance (with ``ks_threshold``).
        min_samples: Values needed in the window before the first test (see the module docstring).
        min_interval_s: Seconds at least between two tests; 0: by count only. At 1,500 images/s the count
            rule alone runs 15 tests a second (~1 ms each), while drift shows over minutes. It also sets
            how many images are worth featurizing (``admit``): a window's worth per interval.
        clock: Monotonic seconds (tests pass their own).
        executor: Where tests run; None: inline.
        on_report: Called with every new report, from the thread that ran the test (metrics hook in here).

    Raises:
        ValueError: an empty baseline, a feature without finite values, or a bad parameter.
    """

    def __init__(
        self,
        baseline: Mapping[str, Any],
        *,
        window: int = 1000,
        test_every: int = 100,
        ks_threshold: float = 0.15,
        p_threshold: float = 0.01,
        min_samples: int = 300,
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        on_report: Callable[[DriftReport], None] | None = None,
    ) -> None:
        if window < 1 or test_every < 1 or min_samples < 1:
            raise ValueError(f"window, test_every and min_samples must be >= 1: {window}, {test_every}, {min_samples}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0 seconds, got {min_interval_s}")
        self._min_interval_s, self._clock = min_interval_s, clock
        self._last_test = -math.inf
        if not baseline:
            raise ValueError("drift baseline is empty: the model's config.json has no drift_baseline")
        self._baseline: dict[str, FloatArray] = {}
        for name, values in baseline.items():
            array = np.asarray(values, dtype=np.float64).ravel()
            if array.size == 0 or not np.isfinite(array).all():
                raise ValueError(f"drift baseline feature {name!r} needs finite values, got {array.size} value(s)")
            self._baseline[name] = array
        self._window, self._test_every = window, test_every
        self._ks_threshold, self._p_threshold = ks_threshold, p_threshold
        self._min_samples = min(min_samples, window)
        self._executor, self._on_report = executor, on_report
        # Sorted once: every test compares against the same baseline.
        self._sorted = {name: np.sort(values) for name, values in self._baseline.items()}
        _kstwo()  # scipy.stats loads here, at model load, not in the first test (a second of CPU)
        self._lock = threading.Lock()
        self._ring = {name: np.zeros(window, dtype=np.float64) for name in self._baseline}
        self._head = self._filled = self._observed = 0  # next slot, values held, values ever observed
        self._next_test = max(test_every, self._min_samples)
        self._testing = False  # a test is queued or running on the executor
        self._report = DriftReport({}, False, 0, 0)
        self._tokens, self._refilled = float(window), clock()  # admit()'s bucket: a full window at start
        self.skipped = 0  # images not admitted (see ``admit``)

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(self._baseline)

    @property
    def observed(self) -> int:
        """Values (images) observed per feature since the monitor started."""
        return self._observed

    @property
    def report(self) -> DriftReport:
        return self._report

    @property
    def alarm(self) -> bool:
        return self._report.alarm

    def admit(self, images: int) -> bool:
        """Whether a batch of ``images`` is worth featurizing for ``observe``: at most a window's worth
        per ``min_interval_s``, spread over the interval (a token bucket that holds one window); every
        image when there is no interval.

        A test sees the last ``window`` images, at most one a ``min_interval_s``: under load a server
        serves many windows between two tests, and the channel means of the images no test will see
        were the monitors' largest cost (1,000 images/s are taken by default; a small model serves
        3,000). The sample is spread evenly over time, so the window still follows the traffic.
        """
        if not self._min_interval_s:
            return True
        with self._lock:
            now = self._clock()
            refill = (now - self._refilled) * self._window / self._min_interval_s
            self._tokens = min(float(self._window), self._tokens + refill)
            self._refilled = now
            need = min(images, self._window)  # a batch larger than the window: when the bucket is full
            if self._tokens < need:
                self.skipped += images
                return False
            self._tokens -= need
            return True

    def observe(self, features: Mapping[str, npt.ArrayLike]) -> DriftReport | None:
        """Add one request's values (one per image) for every baseline feature.

        Args:
            features: Feature name -> 1-D values, the same count for every feature; extra names are
                ignored, missing ones are an error.

        Returns:
            The new report when this call ran the tests inline, else None.

        Raises:
            ValueError: a baseline feature is missing or the counts differ.
        """
        rows = self._rows(features)
        count = next(iter(rows.values())).size
        if count == 0:
            return None
        window = self._window
        with self._lock:
            head = self._head
            for name, values in rows.items():
                ring = self._ring[name]
                if count >= window:
                    ring[:] = values[-window:]
                elif head + count <= window:
                    ring[head : head + count] = values
                else:
                    split = window - head
                    ring[head:] = values[:split]
                    ring[: count - split] = values[split:]
            self._head = 0 if count >= window else (head + count) % window
            self._filled = min(window, self._filled + count)
            self._observed += count
            if self._observed < self._next_test or self._testing:
                return None
            if self._min_interval_s:
                now = self._clock()
                if now - self._last_test < self._min_interval_s:
                    return None  # due by count: the first observe after the interval runs it
                self._last_test = now
            self._next_test = self._observed + self._test_every
            # A copy, in any order: the KS test does not care which value is oldest.
            snapshot = {name: ring[: self._filled].copy() for name, ring in self._ring.items()}
            observed = self._observed
            self._testing = self._executor is not None
        if self._executor is None:
            return self._test(snapshot, observed)
        self._executor.submit(self._test_logged, snapshot, observed)
        return None

    def _test_logged(self, window: Mapping[str, FloatArray], observed: int) -> None:
        try:
            self._test(window, observed)
        except Exception:  # on the executor nobody waits for the future: say it here
            log.exception("drift test failed; the previous report stays")

    def _rows(self, features: Mapping[str, npt.ArrayLike]) -> dict[str, FloatArray]:
        missing = [name for name in self._baseline if name not in features]
        if missing:
            raise ValueError(f"drift features {missing} missing; the baseline has {list(self._baseline)}")
        rows = {name: np.asarray(features[name], dtype=np.float64).ravel() for name in self._baseline}
        if len({values.size for values in rows.values()}) != 1:
            counts = {name: values.size for name, values in rows.items()}
            raise ValueError(f"drift features disagree on the number of images: {counts}")
        return rows

    def _test(self, window: Mapping[str, FloatArray], observed: int) -> DriftReport:
        try:
            results: dict[str, FeatureTest] = {}
            for name, values in window.items():
                statistic, p_value = ks_two_sample(values, self._sorted[name])
                results[name] = FeatureTest(statistic, p_value if math.isfinite(p_value) else 1.0)
            alarm = any(t.statistic > self._ks_threshold and t.p_value < self._p_threshold for t in results.values())
            report = DriftReport(results, alarm, len(next(iter(window.values()))), observed)
            with self._lock:
                self._report = report
        finally:
            with self._lock:
                self._testing = False
        if self._on_report is not None:
            self._on_report(report)
        return report


def ks_two_sample(sample: FloatArray, sorted_reference: FloatArray) -> tuple[float, float]:
    """Two-sided two-sample KS statistic and asymptotic p-value, as ``scipy.stats.ks_2samp(sample,
    reference, method="asymp")`` computes them, with the reference already sorted.

    Written out rather than calling ``ks_2samp`` because the baseline never changes: ks_2samp sorts both
    samples and picks its method on every call (about a millisecond per feature on the benchmark VM),
    while this sorts only the window. The p-value is scipy's own ``kstwo.sf(D, round(n*m/(n+m)))``.
    """
    window = np.sort(sample)
    n, m = window.size, sorted_reference.size
    if n == 0 or m == 0:
        return 0.0, 1.0
    both = np.concatenate([window, sorted_reference])
    gaps = np.searchsorted(window, both, side="right") / n - np.searchsorted(sorted_reference, both, side="right") / m
    statistic = float(np.abs(gaps).max())
    big, small = max(n, m), min(n, m)
    return statistic, float(_kstwo().sf(statistic, np.round(big * small / (big + small))))


def _kstwo() -> Any:
    from scipy.stats import kstwo

    return kstwo


def rgb_baseline(drift_baseline: Mapping[str, Any]) -> dict[str, list[float]] | None:
    """The ``r``/``g``/``b`` lists of a ``config.json`` ``drift_baseline`` written by ``channel_baseline``;
    None when it has none (older or hand-written configs): serve that version without a drift monitor."""
    try:
        found = {name: [float(v) for v in drift_baseline[name]] for name in CHANNELS}
    except (KeyError, TypeError, ValueError):
        return None
    return found if all(found.values()) else None


def baseline_features(
    drift_baseline: Mapping[str, Any], preprocessing: Mapping[str, Any]
) -> dict[str, list[float]] | None:
    """The features a version is watched on, with their training samples, from its ``config.json``.

    RGB and BGR models: ``rgb_baseline``. Colour "L" models: ``{"l": [...]}``, the baseline's own ``l``
    list when it has one, else the luma of its r/g/b lists image by image, on the same 0..255 scale.
    None when there is no usable baseline: serve that version without a drift monitor.
    """
    if input_channels(preprocessing) == 3:
        return rgb_baseline(drift_baseline)
    try:
        own = [float(v) for v in drift_baseline[GREY]]
    except (KeyError, TypeError, ValueError):
        own = []
    if own:
        return {GREY: own}
    rgb = rgb_baseline(drift_baseline)
    if rgb is None or len({len(values) for values in rgb.values()}) != 1:
        return None  # channels of unequal length cannot be paired image by image
    wr, wg, wb = LUMA_WEIGHTS
    return {GREY: [wr * r + wg * g + wb * b for r, g, b in zip(rgb["r"], rgb["g"], rgb["b"], strict=True)]}


def channel_means(
    batch: npt.ArrayLike, preprocessing: Mapping[str, Any], *, scale: float = PIXEL_SCALE
) -> dict[str, FloatArray]:
    """Per-image channel means of a normalised NCHW model input, on the baseline's scale.

    Undoes ``serving.preprocessing.preprocess``: channels are in ``preprocessing["colour"]`` order
    ("RGB" or "BGR"), each normalised as ``(x - mean[c]) / std[c]`` with ``mean``/``std`` in RGB order;
    colour "L" has one grey channel, normalised with its one mean and std.
    The mean is linear, so the spatial mean is taken first and un-normalised after: ``mean(x) * std +
    mean``, times ``scale``. The baseline was measured on the full-size image and this on the resized
    one; bilinear resizing keeps the mean to within a fraction of a grey level on natural images.

    Args:
        batch: ``(N, 3, H, W)`` floats, ``(N, 1, H, W)`` for colour "L".
        preprocessing: The model's ``config.json`` ``preprocessing`` (``PreprocessSpec.to_dict()``);
            ``mean`` and ``std`` are required, ``colour`` defaults to "RGB".
        scale: 255 for ``channel_baseline``'s uint8 scale, 1 for 0..1.

    Returns:
        ``{"r": (N,), "g": (N,), "b": (N,)}``; ``{"l": (N,)}`` for colour "L".

    Raises:
        ValueError: the batch does not have the colour's channels, or ``preprocessing`` lacks a usable
            mean/std/colour.
    """
    array = np.asarray(batch)
    colour = preprocessing.get("colour", "RGB")
    if colour not in ("RGB", "BGR", "L"):
        raise ValueError(f"preprocessing colour must be 'RGB', 'BGR' or 'L', got {colour!r}")
    channels = input_channels(preprocessing)
    if array.ndim != 4 or array.shape[1] != channels:
        raise ValueError(
            f"channel_means needs an (N, {channels}, H, W) batch for colour {colour}, got shape {array.shape}"
        )
    return ChannelSpec.of(preprocessing, scale).features(plane_means(array))


@dataclass(frozen=True)
class ChannelSpec:
    """How to undo one version's input normalisation, parsed once: the feature name of each tensor
    channel and its ``mean``/``std``. The monitors' drain takes ``plane_means`` of every batch (one BLAS
    call each) and un-normalises the joined means once per tick: parsing the spec per batch was most of
    a one-image batch's cost (17 us of the drain's 24 per request at c=1)."""

    names: tuple[str, ...]  # per tensor channel: ("r", "g", "b"), ("b", "g", "r") or ("l",)
    mean: FloatArray  # per tensor channel
    std: FloatArray
    scale: float

    @classmethod
    def of(cls, preprocessing: Mapping[str, Any], scale: float = PIXEL_SCALE) -> ChannelSpec:
        """Raises ValueError as ``channel_means`` does for a bad colour, mean or std."""
        colour = preprocessing.get("colour", "RGB")
        if colour not in ("RGB", "BGR", "L"):
            raise ValueError(f"preprocessing colour must be 'RGB', 'BGR' or 'L', got {colour!r}")
        channels = input_channels(preprocessing)
        what = "(grey)" if channels == 1 else "(R, G, B)"
        try:
            mean = [float(v) for v in preprocessing["mean"]]
            std = [float(v) for v in preprocessing["std"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"preprocessing needs numeric 'mean' and 'std' {what}: {exc}") from exc
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"preprocessing mean and std need {channels} value(s) {what}, got {mean} and {std}")
        if channels == 1:
            return cls((GREY,), np.array(mean), np.array(std), scale)
        order = (0, 1, 2) if colour == "RGB" else (2, 1, 0)  # tensor channel -> RGB index
        pick = list(order)
        return cls(tuple(CHANNELS[i] for i in order), np.array(mean)[pick], np.array(std)[pick], scale)

    def features(self, spatial: FloatArray) -> dict[str, FloatArray]:
        """Feature name -> per-image mean on the baseline's scale, from ``plane_means`` rows (N, C)."""
        values = (spatial * self.std + self.mean) * self.scale
        return {name: values[:, index] for index, name in enumerate(self.names)}


def plane_means(array: npt.NDArray[Any]) -> FloatArray:
    """The mean of every (image, channel) plane of an NCHW batch, as float64.

    A matrix-vector product with ones (BLAS) rather than ``mean(axis=(2, 3))``: on the telemetry thread of a
    busy server this runs for every batch, and for a small-model batch (8 x 3 x 64 x 64) it takes 5 us
    against 42 us (33 us with float64 einsum). Float32 accumulation in BLAS's blocked dot products is within
    1e-7 of the float64 mean here, far below a grey level after un-normalising.
    """
    n, c, h, w = array.shape
    if not n * c * h * w:
        return np.zeros((n, c), dtype=np.float64)
    flat = np.ascontiguousarray(array).reshape(n * c, h * w)
    if flat.dtype in (np.float32, np.float64):
        sums = flat @ _ones(h * w, flat.dtype.str)
    else:
        sums = flat.sum(axis=1, dtype=np.float64)
    means: FloatArray = (np.asarray(sums, dtype=np.float64) / (h * w)).reshape(n, c)
    return means


@functools.lru_cache(maxsize=16)
def _ones(size: int, dtype: str) -> npt.NDArray[Any]:
    return np.ones(size, dtype=dtype)
