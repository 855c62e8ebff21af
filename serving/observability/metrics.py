"""Prometheus metrics of the server, on one registry per server (so several servers in one process, as in
tests, never share series). Names carry their units.

Every per-version family is labelled ``{model, version}``; ``forget(model, version)`` drops a version's
series when it is unloaded, so a dashboard never shows a version that is gone.

Request labels come from the caller (any model name, any version, megabytes long), and every new label set
is a series kept forever: ``observe`` labels only versions the data plane reported ``loaded`` and counts
everything else under ``UNKNOWN`` (model "_unknown", version ""), so the series count is bounded by what
the repository holds.

With several worker processes (serving/supervisor.py) every family lives in prometheus-client's
multiprocess mode: each worker writes its values to files in one shared folder, and ``/metrics`` on any
worker serves their aggregate (counters and histograms summed; each gauge says how it combines). The
multiprocess files cannot drop a series, so there ``forget`` works by filtering: a scrape lists only the
versions the scraping worker has loaded (every worker loads the same ones) and ``UNKNOWN``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from serving.observability.gpu import GpuCollector, NvmlLoader

# From 100 microseconds: a small model answers in well under a millisecond.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Queue waits are often tens of microseconds (max_queue_delay_us=0 batches what is already queued).
QUEUE_BUCKETS = (0.00001, 0.000025, 0.00005, *LATENCY_BUCKETS)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Entropy of one answer in bits: 0 is one-hot, log2(classes) is uniform (2 bits for 4 classes).
ENTROPY_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)

_VERSION = ("model", "version")
# The labels of a request for a model or version that is not loaded (see the module docstring).
UNKNOWN = ("_unknown", "")


class BatchMetrics:
    """The ``BatchObserver`` of one model version (``serving.batching``): batch size, queue time per
    request and execution time per batch. Called on the batcher's worker thread; label children are
    resolved once here, so a batch costs a few histogram updates."""

    def __init__(self, size: Histogram, queue: Histogram, execution: Histogram) -> None:
        self._size, self._queue, self._execution = size, queue, execution

    def on_batch(self, batch_rows: int, queue_ns: Sequence[int], exec_ns: int, ok: bool) -> None:
        # Failed batches count too: they occupied the runtime and their requests waited in the queue.
        self._size.observe(batch_rows)
        if len(queue_ns) == 1:  # one request (a quiet server): plain observe is cheapest
            self._queue.observe(queue_ns[0] / 1e9)
        else:
            observe_many(self._queue, [waited / 1e9 for waited in queue_ns])
        self._execution.observe(exec_ns / 1e9)


def observe_many(histogram: Any, values: Sequence[float] | np.ndarray) -> None:
    """``histogram.observe(v)`` for every ``v``: one increment per bucket that got values, not one per value.

    prometheus-client has no bulk observe, and the monitors' drain observes thousands of entropies a
    second (1.9 us each, a tenth of the telemetry thread's time at 2,300 images/s), the batcher one queue
    time per request. So this adds each bucket's count at once through the child's own value objects
    (``_upper_bounds``, ``_buckets``, ``_sum``, the ones ``observe`` increments, so multiprocess mode
    works unchanged); should a prometheus-client release rename them, it falls back to ``observe``
    (tests/serving/observability/test_metrics.py pins the two to the same exposition).
    """
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for value in np.asarray(values, dtype=np.float64).ravel().tolist():
            histogram.observe(value)
        return
    if isinstance(values, np.ndarray) and values.size > _BISECT_MAX:
        flat = values.astype(np.float64, copy=False).ravel()
        # The first bound >= value, as observe's "value <= bound"; NaN sorts past +Inf: no bucket, as there.
        counts = np.bincount(np.searchsorted(bounds, flat, side="left"), minlength=len(bounds) + 1)
        added = float(flat.sum())
        hits = [(index, count) for index, count in enumerate(counts[: len(bounds)].tolist()) if count]
    else:
        plain = [float(value) for value in (values.ravel().tolist() if isinstance(values, np.ndarray) else values)]
        if not plain:
            return
        tally: dict[int, int] = {}
        for value in plain:
            index = bisect.bisect_left(bounds, value)
            if index < len(bounds) and value <= bounds[index]:  # NaN: no bucket
                tally[index] = tally.get(index, 0) + 1
        added = sum(plain)
        hits = list(tally.items())
    total.inc(added)
    for index, count in hits:
        buckets[index].inc(count)


# Up to this many values a Python loop over bisect beats numpy's per-call overhead (a batch's queue times).
_BISECT_MAX = 32


class ServerMetrics:
    """Every metric the server exports, on ``self.registry`` (served by the side port's ``/metrics``).

    Args:
        nvml: How to import NVML for the GPU gauges; default ``import pynvml`` (nvidia-ml-py), lazily, on
            the first scrape. Tests pass a fake. Without NVML or a GPU the GPU families are absent.
        multiprocess_dir: The shared folder of a multi-process server (``PROMETHEUS_MULTIPROC_DIR``, set
            in this process's environment before prometheus_client was imported); None: one process.
    """

    def __init__(self, *, nvml: NvmlLoader | None = None, multiprocess_dir: Path | None = None) -> None:
        # The families register here; with workers this registry is never scraped (the files are).
        own = CollectorRegistry()
        # Registered in this order, which is the order /metrics lists them in.
        self._request_families(own)
        self._batch_families(own)
        self._monitor_families(own)
        self._engine_cache_families(own)
        self.telemetry_dropped = Counter(
            "sluicegate_telemetry_dropped",
            "Monitor batches and request-log lines dropped because the telemetry thread fell behind.",
            ["kind"],
            registry=own,
        )
        self.records_dropped = Counter(
            "sluicegate_request_records_dropped",
            "Request records (request-log lines) dropped because the telemetry thread or the log sink fell "
            "behind (telemetry_max_pending waiting); those requests cannot be found by sluicegate lineage.",
            registry=own,
        )
        self.auth_refused = Counter(
            "sluicegate_auth_refused",
            "Calls refused for want of the admin token, by action and reason (missing, wrong, disabled).",
            ["action", "reason"],
            registry=own,
        )
        if multiprocess_dir is None:
            self.registry = own
        else:
            # What /metrics serves: every worker's files, aggregated, less the versions gone.
            self.registry = CollectorRegistry()
            self.registry.register(_LoadedVersionsOnly(multiprocess_dir, self._known_labels))
        self.gpu = GpuCollector(nvml)  # the node's GPUs: the same for every worker, read at scrape time
        self.registry.register(self.gpu)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._known: set[tuple[str, str]] = set()  # loaded versions: the only request labels taken as sent
        self._lock = threading.Lock()  # known, and the children made from it, against forget()
        # Every per-version family with its label names, for forget().
        self._per_version: list[tuple[MetricWrapperBase, tuple[str, ...]]] = [
            (self.requests, (*_VERSION, "code")),
            (self.fallback_level, (*_VERSION, "runtime")),
            (self.drift_statistic, (*_VERSION, "feature")),
            (self.drift_p_value, (*_VERSION, "feature")),
            (self.latency, _VERSION),
            (self.queue_duration, _VERSION),
            (self.batch_size, _VERSION),
            (self.batch_execution, _VERSION),
            (self.entropy, _VERSION),
            (self.entropy_collapse, _VERSION),
            (self.drift_alarm, _VERSION),
            (self.engine_cache_hits, _VERSION),
            (self.engine_cache_lookups, _VERSION),
        ]

    def _request_families(self, registry: CollectorRegistry) -> None:
        """Requests by status code, latency, the runtime fallback level and readiness."""
        self.requests = Counter(
            "sluicegate_inference_requests",  # exposed as sluicegate_inference_requests_total
            "Inference requests by model, version and gRPC status code.",
            [*_VERSION, "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "sluicegate_inference_request_duration_seconds",
            "Time from receiving an inference request to answering it (successful requests).",
            _VERSION,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.fallback_level = Gauge(
            "sluicegate_runtime_fallback_level",
            "Runtime level a model version runs on (0: the best configured; higher: fallen back).",
            [*_VERSION, "runtime"],
            registry=registry,
            multiprocess_mode="liveall",  # each worker falls back on its own: one series per worker (pid)
        )
        # Gauges say how workers' values combine (multiprocess_mode; ignored in one process). "live": a dead
        # worker's value is dropped (serving/supervisor.py marks it dead), not kept for ever.
        self.ready = Gauge(
            "sluicegate_server_ready",
            "1 when every configured model is loaded (with workers: in every live worker).",
            registry=registry,
            multiprocess_mode="livemin",
        )

    def _batch_families(self, registry: CollectorRegistry) -> None:
        """Queue time, batch size and batch execution time (fed through ``batch_observer``)."""
        self.queue_duration = Histogram(
            "sluicegate_queue_duration_seconds",
            "Time a request waited in its version's batch queue before its batch started.",
            _VERSION,
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "sluicegate_batch_size",
            "Rows in each batch the runtime ran.",
            _VERSION,
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_execution = Histogram(
            "sluicegate_batch_execution_duration_seconds",
            "Time to run one batch: concatenate, runtime call, split.",
            _VERSION,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def _monitor_families(self, registry: CollectorRegistry) -> None:
        """Output entropy and its collapse verdict; feature drift KS statistic, p-value and alarm."""
        self.entropy = Histogram(
            "sluicegate_output_entropy_bits",
            "Shannon entropy of each answered row's softmax, in bits.",
            _VERSION,
            buckets=ENTROPY_BUCKETS,
            registry=registry,
        )
        self.entropy_collapse = Gauge(
            "sluicegate_output_entropy_collapse",
            "1 while the output-entropy window looks collapsed (see serving/observability/entropy.py).",
            _VERSION,
            registry=registry,
            multiprocess_mode="livemax",  # each worker judges its share of the traffic: any collapse counts
        )
        self.drift_statistic = Gauge(
            "sluicegate_feature_drift_ks_statistic",
            "Latest two-sample KS statistic of a feature's sliding window against the training baseline.",
            [*_VERSION, "feature"],
            registry=registry,
            multiprocess_mode="livemax",  # the worst worker's window
        )
        self.drift_p_value = Gauge(
            "sluicegate_feature_drift_p_value",
            "p-value of the latest KS test of a feature's window against the training baseline.",
            [*_VERSION, "feature"],
            registry=registry,
            multiprocess_mode="livemin",  # the worst worker's window
        )
        self.drift_alarm = Gauge(
            "sluicegate_feature_drift_alarm",
            "1 while any feature's latest KS test exceeds both drift thresholds.",
            _VERSION,
            registry=registry,
            multiprocess_mode="livemax",
        )

    def _engine_cache_families(self, registry: CollectorRegistry) -> None:
        """TensorRT engine cache hits and lookups."""
        self.engine_cache_hits = Counter(
            "sluicegate_tensorrt_engine_cache_hits",
            "TensorRT engine cache lookups that found a built engine.",
            _VERSION,
            registry=registry,
        )
        self.engine_cache_lookups = Counter(
            "sluicegate_tensorrt_engine_cache_lookups",
            "TensorRT engine cache lookups (hit ratio: hits_total / lookups_total).",
            _VERSION,
            registry=registry,
        )

    def _known_labels(self) -> set[tuple[str, str]]:
        with self._lock:
            return {*self._known, UNKNOWN}

    def observe(self, model: str, version: str, code: str, seconds: float) -> None:
        """One answered request: counted by status code; its latency recorded when it succeeded. A model
        or version that is not loaded is counted under ``UNKNOWN``."""
        # The label children are looked up once per (model, version, code): labels() costs more than
        # the increment itself, on every request. Only known labels and UNKNOWN are ever cached, so a hit
        # needs no other check.
        children = self._children.get((model, version, code))
        if children is None:
            children = self._child(model, version, code)
        children[0].inc()
        if children[1] is not None:
            children[1].observe(seconds)

    def _child(self, model: str, version: str, code: str) -> tuple[Any, Any]:
        with self._lock:
            if (model, version) not in self._known:
                model, version = UNKNOWN
            # The code is the server's own (a status code name), never request text.
            key = (model, version, code)
            children = self._children.get(key)
            if children is None:
                latency = self.latency.labels(model, version) if code == "OK" else None
                children = self._children[key] = (self.requests.labels(model, version, code), latency)
            return children

    def loaded(self, model: str, version: str) -> None:
        """A version now serves: its requests are labelled with its name from here on."""
        with self._lock:
            self._known.add((model, version))

    def refused(self, action: str, reason: str) -> None:
        """The ``Authorizer``'s ``on_refused`` (``action`` is one of the server's fixed call names)."""
        self.auth_refused.labels(action, reason).inc()

    def dropped(self, kind: str) -> None:
        """The telemetry pipeline's ``on_drop``."""
        self.telemetry_dropped.labels(kind).inc()

    def set_level(self, model: str, version: str, runtime: str, level: int) -> None:
        # One series per version: drop the old runtime's label set so the gauge shows only the current one.
        _remove_matching(self.fallback_level, (*_VERSION, "runtime"), {"model": model, "version": version})
        self.fallback_level.labels(model, version, runtime).set(level)

    def batch_observer(self, model: str, version: str) -> BatchMetrics:
        """The ``observer=`` to give this version's ``DynamicBatcher``."""
        return BatchMetrics(
            self.batch_size.labels(model, version),
            self.queue_duration.labels(model, version),
            self.batch_execution.labels(model, version),
        )

    def observe_entropy(self, model: str, version: str, bits: Iterable[float], collapsed: bool) -> None:
        """Entropies of a request's rows and the monitor's current verdict."""
        observe_many(self.entropy.labels(model, version), bits if isinstance(bits, np.ndarray) else list(bits))
        self.entropy_collapse.labels(model, version).set(1 if collapsed else 0)

    def set_drift(self, model: str, version: str, tests: Mapping[str, tuple[float, float]], alarm: bool) -> None:
        """The drift monitor's latest tests: feature -> (KS statistic, p-value), and its alarm."""
        for feature, (statistic, p_value) in tests.items():
            self.drift_statistic.labels(model, version, feature).set(statistic)
            self.drift_p_value.labels(model, version, feature).set(p_value)
        self.drift_alarm.labels(model, version).set(1 if alarm else 0)

    def engine_cache_lookup(self, model: str, version: str, hit: bool) -> None:
        self.engine_cache_lookups.labels(model, version).inc()
        if hit:
            self.engine_cache_hits.labels(model, version).inc()

    def forget(self, model: str, version: str) -> None:
        """Drop every series of an unloaded version (request counters included); call it after the
        version's batcher has stopped, since its ``batch_observer`` keeps writing to the dropped series."""
        wanted = {"model": model, "version": version}
        with self._lock:
            # Requests still finishing from here on are counted under UNKNOWN, not in a revived series.
            self._known.discard((model, version))
            for key in [key for key in self._children if key[:2] == (model, version)]:
                self._children.pop(key, None)
        for family, names in self._per_version:
            _remove_matching(family, names, wanted)


def _remove_matching(family: MetricWrapperBase, names: Sequence[str], wanted: Mapping[str, str]) -> None:
    """Remove every child of ``family`` (labelled ``names``) whose labels include ``wanted``.

    In multiprocess mode a child cannot be removed (its value stays in the worker's file): a gauge's is
    set to NaN, which the scrape leaves out; counters and histograms are left to the version filter."""
    children = {
        tuple(sample.labels[name] for name in names)
        for metric in family.collect()
        for sample in metric.samples
        if all(sample.labels.get(key) == value for key, value in wanted.items())
    }
    shared = _multiprocess()
    for values in children:
        if not shared:
            family.remove(*values)
        elif isinstance(family, Gauge):
            family.labels(*values).set(math.nan)


def _multiprocess() -> bool:
    # prometheus_client chose the value class at import from PROMETHEUS_MULTIPROC_DIR; ask it, not the env.
    from prometheus_client import values

    return values.ValueClass is not values.MutexValue


class _LoadedVersionsOnly:
    """prometheus-client's ``MultiProcessCollector`` over ``path``, less the series of versions that are not
    loaded (``loaded()`` gives the (model, version) pairs to keep) and gauges set to NaN (removed)."""

    def __init__(self, path: Path, loaded: Callable[[], set[tuple[str, str]]]) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._inner = MultiProcessCollector(None, path=str(path))  # type: ignore[no-untyped-call]
        self._loaded = loaded

    def collect(self) -> Iterator[Metric]:
        keep = self._loaded()
        for metric in self._inner.collect():  # type: ignore[no-untyped-call]
            metric.samples = [
                sample
                for sample in metric.samples
                if ("model" not in sample.labels or (sample.labels["model"], sample.labels.get("version", "")) in keep)
                and not (metric.type == "gauge" and math.isnan(sample.value))
            ]
            yield metric
