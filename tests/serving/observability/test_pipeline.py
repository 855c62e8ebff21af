"""The telemetry thread (serving/observability/pipeline.py) and the per-version monitors fed whole batches
(serving/observability/monitors.py): work runs in order off the caller's thread, a full queue drops and
counts instead of growing, a failing call does not stop the thread, and batches waiting for one drain
are monitored together, row for row."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.observability.drift import DriftMonitor
from serving.observability.entropy import EntropyMonitor
from serving.observability.metrics import ServerMetrics
from serving.observability.monitors import VersionMonitors, min_confidence
from serving.observability.pipeline import TelemetryPipeline

IDENTITY = {"height": 4, "width": 4, "colour": "RGB", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}


def test_calls_run_in_order_on_the_telemetry_thread() -> None:
    pipeline = TelemetryPipeline()
    seen: list[tuple[int, str]] = []
    try:
        for index in range(50):
            assert pipeline.submit("t", lambda i: seen.append((i, threading.current_thread().name)), index)
        assert pipeline.flush(10)
    finally:
        pipeline.close()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"telemetry"}


def test_tick_hooks_run_on_the_thread_and_flush_waits_for_them() -> None:
    """The request records drain through a hook: ``flush`` must cover what was queued before it, and a
    failing hook must not stop the ticks."""
    pipeline = TelemetryPipeline(interval_s=60)  # a tick only when flush wakes the thread
    queued: list[int] = []
    drained: list[tuple[int, str]] = []

    def drain() -> None:
        while queued:
            drained.append((queued.pop(0), threading.current_thread().name))

    failures = 0

    def broken() -> None:
        nonlocal failures
        failures += 1
        raise RuntimeError("sink gone")

    try:
        pipeline.every_tick("broken", broken)
        pipeline.every_tick("records", drain)
        queued.extend(range(5))
        assert pipeline.flush(10)
        assert drained == [(i, "telemetry") for i in range(5)]
        queued.append(5)
        assert pipeline.flush(10)
        assert [i for i, _ in drained] == list(range(6)) and failures >= 2
    finally:
        pipeline.close()


def test_an_idle_pipeline_does_not_tick_and_a_poke_wakes_it_within_a_tick() -> None:
    """Ticks only when there is work: an idle server's telemetry thread sleeps."""
    pipeline = TelemetryPipeline(interval_s=0.02)
    ticks: list[float] = []
    try:
        pipeline.every_tick("records", lambda: ticks.append(time.monotonic()))
        time.sleep(0.5)  # 25 ticks' worth
        assert ticks == []
        poked = time.monotonic()
        pipeline.poke()
        deadline = poked + 5
        while not ticks and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(ticks) == 1 and ticks[0] - poked < 2.0
        assert pipeline.submit("call", lambda: None)  # a submitted call wakes it too
        deadline = time.monotonic() + 5
        while len(ticks) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(ticks) == 2
        time.sleep(0.3)
        assert len(ticks) == 2, "no work: no more ticks"
    finally:
        pipeline.close()


def test_a_full_queue_drops_and_counts_and_a_failing_call_is_survived() -> None:
    dropped: Counter[str] = Counter()
    pipeline = TelemetryPipeline(max_pending=3, max_pending_bytes=100, on_drop=lambda kind: dropped.update([kind]))
    gate = threading.Event()
    ran: list[int] = []
    try:
        assert pipeline.submit("block", gate.wait, 10)
        assert pipeline.flush(0.2) is False  # the thread is parked in gate.wait
        results = [pipeline.submit("log", ran.append, i) for i in range(4)]
        assert results == [True, True, True, False] and dropped["log"] == 1
        # Bytes: a line holding its request's input counts against max_pending_bytes.
        gate.set()
        assert pipeline.flush(10)
        assert pipeline.submit("log", ran.append, 100, size=80)
        assert pipeline.submit("boom", _raise)  # logged on the thread, which goes on
        assert pipeline.flush(10)
        assert pipeline.pending_bytes == 0
        gate.clear()
        assert pipeline.submit("block", gate.wait, 10)
        assert pipeline.submit("log", ran.append, 101, size=80)
        assert not pipeline.submit("log", ran.append, 102, size=80)  # 160 bytes would exceed 100
        gate.set()
        assert pipeline.flush(10)
    finally:
        pipeline.close()
    assert 100 in ran and 101 in ran and 102 not in ran
    assert not pipeline.submit("late", ran.append, 1)  # closed: dropped
    with pytest.raises(ValueError, match="max_pending"):
        TelemetryPipeline(max_pending=0)


def _raise() -> None:
    raise RuntimeError("a monitor bug")


def _series(metrics: ServerMetrics, name: str) -> list[tuple[dict[str, str], float]]:
    text = generate_latest(metrics.registry).decode()
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def _monitors(metrics: ServerMetrics, pipeline: TelemetryPipeline, baseline: dict[str, list[float]]) -> VersionMonitors:
    drift = DriftMonitor(baseline, window=200, test_every=50, min_samples=100)
    return VersionMonitors(
        "m",
        "1",
        metrics,
        pipeline,
        entropy=EntropyMonitor(100, min_rows=20),
        logits="logits",
        drift=drift,
        image_input="image",
        preprocessing=IDENTITY,
    )


def test_batches_waiting_for_one_drain_are_monitored_together() -> None:
    metrics = ServerMetrics()
    rng = np.random.default_rng(0)
    baseline = {channel: rng.uniform(0.3, 0.7, 500).tolist() for channel in "rgb"}
    pipeline = TelemetryPipeline()
    monitors = _monitors(metrics, pipeline, baseline)
    gate = threading.Event()
    try:
        pipeline.submit("block", gate.wait, 10)
        rows = 0
        for size in (1, 3, 2, 8, 4) * 6:
            image = np.full((size, 3, 4, 4), 0.5, dtype=np.float32)
            monitors.on_batch({"image": image}, {"logits": rng.normal(size=(size, 4)).astype(np.float32)})
            rows += size
        gate.set()
        assert pipeline.flush(10)
    finally:
        pipeline.close()
    assert monitors.drift is not None and monitors.drift.observed == rows  # every image of every batch
    assert monitors.entropy.state.rows == min(rows, 100)
    count = [v for labels, v in _series(metrics, "sluicegate_output_entropy_bits_count") if labels["model"] == "m"]
    assert count == [rows]


def test_abnormal_follows_the_drift_alarm_and_an_entropy_collapse() -> None:
    metrics = ServerMetrics()
    baseline = {channel: np.random.default_rng(1).uniform(100, 160, 500).tolist() for channel in "rgb"}
    pipeline = TelemetryPipeline()
    monitors = _monitors(metrics, pipeline, baseline)
    try:
        rng = np.random.default_rng(2)
        for _ in range(20):  # in distribution on the 0..255 scale: identity preprocessing of 0..1 pixels
            image = rng.uniform(100, 160, size=(8, 1, 1, 3)).repeat(4, 1).repeat(4, 2) / 255.0
            monitors.on_batch(
                {"image": np.transpose(image, (0, 3, 1, 2)).astype(np.float32)}, {"logits": rng.normal(size=(8, 4))}
            )
        assert pipeline.flush(10)
        assert not monitors.abnormal
        dark = np.zeros((8, 3, 4, 4), dtype=np.float32)
        collapsed = np.tile(np.array([[9.0, 0.0, 0.0, 0.0]]), (8, 1))
        for _ in range(40):
            monitors.on_batch({"image": dark}, {"logits": collapsed})
        assert pipeline.flush(10)
    finally:
        pipeline.close()
    assert monitors.drift is not None and monitors.drift.alarm and monitors.entropy.collapsed
    assert monitors.abnormal


def test_min_confidence_is_the_least_sure_row() -> None:
    logits: Any = np.array([[5.0, 0.0], [0.0, 0.0]])
    assert min_confidence(logits) == pytest.approx(0.5)
    assert min_confidence(None) is None and min_confidence(np.zeros(3)) is None
