"""ServerMetrics on a real registry, fed by a real DynamicBatcher; exposition as Prometheus scrapes it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest

from serving.batching import DynamicBatcher
from serving.observability.metrics import ServerMetrics, observe_many


def no_nvml() -> Any:
    raise ImportError("No module named 'pynvml'")


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_requests_are_counted_by_code_and_latency_kept_for_successes() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    metrics.loaded("pcb", "1")
    metrics.observe("pcb", "1", "OK", 0.0004)
    metrics.observe("pcb", "1", "OK", 0.002)
    metrics.observe("pcb", "1", "INVALID_ARGUMENT", 0.0001)
    text = generate_latest(metrics.registry).decode()
    assert 'sluicegate_inference_requests_total{code="OK",model="pcb",version="1"} 2.0' in text
    assert value(metrics, "sluicegate_inference_requests_total", model="pcb", version="1", code="INVALID_ARGUMENT") == 1
    assert value(metrics, "sluicegate_inference_request_duration_seconds_count", model="pcb", version="1") == 2
    # sub-millisecond buckets
    bucket = "sluicegate_inference_request_duration_seconds_bucket"
    assert value(metrics, bucket, model="pcb", version="1", le="0.0005") == 1


def test_fallback_level_keeps_one_series_per_version() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    metrics.set_level("pcb", "1", "tensorrt", 0)
    metrics.set_level("pcb", "1", "onnxruntime", 1)
    metrics.set_level("pcb", "2", "tensorrt", 0)
    text = generate_latest(metrics.registry).decode()
    assert 'runtime="tensorrt",version="1"' not in text
    assert value(metrics, "sluicegate_runtime_fallback_level", model="pcb", version="1", runtime="onnxruntime") == 1
    assert value(metrics, "sluicegate_runtime_fallback_level", model="pcb", version="2", runtime="tensorrt") == 0
    metrics.ready.set(1)
    assert value(metrics, "sluicegate_server_ready") == 1


def test_a_real_batcher_feeds_batch_size_and_queue_time() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    batcher = DynamicBatcher(
        lambda inputs: {"y": inputs["x"] * 2},
        max_batch_size=8,
        max_queue_delay_us=0,
        max_queue_size=64,
        name="pcb/1",
        observer=metrics.batch_observer("pcb", "1"),
    )
    futures = [batcher.submit({"x": np.ones((2, 3), dtype=np.float32)}) for _ in range(10)]
    for future in futures:
        assert future.result(timeout=10)["y"].shape == (2, 3)
    assert batcher.stop(timeout=10)
    stats = batcher.stats()
    labels = {"model": "pcb", "version": "1"}
    assert value(metrics, "sluicegate_batch_size_count", **labels) == stats.batches
    assert value(metrics, "sluicegate_batch_size_sum", **labels) == stats.rows == 20
    assert value(metrics, "sluicegate_queue_duration_seconds_count", **labels) == stats.requests == 10
    queued = value(metrics, "sluicegate_queue_duration_seconds_sum", **labels)
    assert queued is not None and abs(queued - stats.queue_ns_total / 1e9) < 1e-6
    assert value(metrics, "sluicegate_batch_execution_duration_seconds_count", **labels) == stats.batches


def test_entropy_drift_and_engine_cache_families() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    labels = {"model": "pcb", "version": "2"}
    metrics.observe_entropy("pcb", "2", [0.0, 0.5, 2.0], collapsed=True)
    metrics.set_drift("pcb", "2", {"r": (0.2, 1e-6), "g": (0.01, 0.9)}, alarm=True)
    metrics.engine_cache_lookup("pcb", "2", hit=True)
    metrics.engine_cache_lookup("pcb", "2", hit=False)
    assert value(metrics, "sluicegate_output_entropy_bits_count", **labels) == 3
    assert value(metrics, "sluicegate_output_entropy_bits_sum", **labels) == 2.5
    assert value(metrics, "sluicegate_output_entropy_collapse", **labels) == 1
    assert value(metrics, "sluicegate_feature_drift_ks_statistic", **labels, feature="r") == 0.2
    assert value(metrics, "sluicegate_feature_drift_p_value", **labels, feature="g") == 0.9
    assert value(metrics, "sluicegate_feature_drift_alarm", **labels) == 1
    assert value(metrics, "sluicegate_tensorrt_engine_cache_hits_total", **labels) == 1
    assert value(metrics, "sluicegate_tensorrt_engine_cache_lookups_total", **labels) == 2


def test_forget_drops_every_series_of_one_version_only() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    for version in ("1", "2"):
        metrics.loaded("pcb", version)
        metrics.observe("pcb", version, "OK", 0.001)
        metrics.set_level("pcb", version, "onnxruntime", 0)
        metrics.batch_observer("pcb", version).on_batch(4, [1000, 2000], 5000, True)
        metrics.observe_entropy("pcb", version, [1.0], collapsed=False)
        metrics.set_drift("pcb", version, {"r": (0.1, 0.5)}, alarm=False)
        metrics.engine_cache_lookup("pcb", version, hit=True)
    metrics.forget("pcb", "1")
    lines = [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("sluicegate_") and 'model="pcb"' in line
    ]
    assert lines and all('version="2"' in line for line in lines)
    assert len({line.split("{")[0] for line in lines}) >= 20  # every family kept its version-2 series


def _request_series(metrics: ServerMetrics) -> list[str]:
    return [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("sluicegate_inference_request")
    ]


def test_request_labels_are_only_loaded_versions_and_one_unknown_label() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    metrics.loaded("pcb", "1")
    metrics.observe("pcb", "1", "OK", 0.001)
    metrics.observe("pcb", "1", "NOT_FOUND", 0.001)
    before = len(_request_series(metrics))
    for i in range(2000):
        metrics.observe(f"nope-{i}", "", "NOT_FOUND", 0.001)
        metrics.observe("pcb", f"v{i}", "NOT_FOUND", 0.001)  # a known model, an unknown version
    metrics.observe("x" * (4 << 20), "y" * 1000, "OK", 0.001)
    after = _request_series(metrics)
    # Nothing but the one unknown label set was added: a counter per code, one latency histogram.
    unknown = [line for line in after if 'model="_unknown",version=""' in line]
    assert len(after) - len(unknown) == before and 0 < len(unknown) < 40
    assert max(len(line) for line in after) < 300
    assert value(metrics, "sluicegate_inference_requests_total", model="_unknown", version="", code="NOT_FOUND") == 4000
    assert value(metrics, "sluicegate_inference_requests_total", model="_unknown", version="", code="OK") == 1
    assert value(metrics, "sluicegate_inference_requests_total", model="pcb", version="1", code="NOT_FOUND") == 1
    assert len(metrics._children) == 4  # the cache of label children is bounded the same way


def test_a_forgotten_version_is_counted_as_unknown_until_loaded_again() -> None:
    metrics = ServerMetrics(nvml=no_nvml)
    metrics.loaded("pcb", "1")
    metrics.observe("pcb", "1", "OK", 0.001)
    metrics.forget("pcb", "1")
    metrics.observe("pcb", "1", "OK", 0.001)  # a request finishing after the unload
    assert value(metrics, "sluicegate_inference_requests_total", model="pcb", version="1", code="OK") is None
    assert value(metrics, "sluicegate_inference_requests_total", model="_unknown", version="", code="OK") == 1
    metrics.loaded("pcb", "1")
    metrics.observe("pcb", "1", "OK", 0.001)
    assert value(metrics, "sluicegate_inference_requests_total", model="pcb", version="1", code="OK") == 1


@pytest.mark.parametrize("count", [0, 1, 8, 33, 5000])
def test_observe_many_gives_the_exposition_of_observe_one_by_one(count: int) -> None:
    """Both paths (bisect for a batch's few values, numpy for a drain's thousands), bucket edges and NaN,
    against plain ``observe`` (test_workers.py scrapes the multiprocess files the same increments write)."""
    from prometheus_client import CollectorRegistry, Histogram

    rng = np.random.default_rng(count)
    values = rng.uniform(-0.5, 9.0, count)
    if count > 4:
        values[:4] = [0.25, 1.0, 8.0, np.nan]  # exactly on bounds (le is inclusive) and not a number
    buckets = (0.001, 0.25, 0.5, 1.0, 2.0, 8.0)

    def exposition(feed: Any) -> str:
        registry = CollectorRegistry()
        child = Histogram("h", "h", ["m"], buckets=buckets, registry=registry).labels("x")
        feed(child)
        return "\n".join(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)

    def one_by_one(child: Any) -> None:
        for v in values.tolist():
            child.observe(v)

    expected = exposition(one_by_one)
    assert exposition(lambda child: observe_many(child, values)) == expected
    assert exposition(lambda child: observe_many(child, values.tolist())) == expected
    if count:
        assert 'h_bucket{le="+Inf",m="x"} ' in expected
