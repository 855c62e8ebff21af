"""Observability of a running server: /metrics parsed with prometheus-client's parser, a real Prometheus
(Debian package) scraping it and answering a PromQL p95, the drift alarm on a dark input stream (and
its silence in distribution), JSON request logs carrying the caller's W3C trace id."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families

from serving.observability.logs import ENVELOPE, REQUEST_FIELDS, REQUEST_LOGGER, input_digest
from serving.preprocessing import preprocess
from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures.models import SPEC, resnet, write_model_version
from tests.fixtures.services import free_port, wait_prometheus_ready

MODEL = "watched"


def pictures(count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """In-distribution images: each has its own brightness, so per-image channel means spread out."""
    levels = rng.uniform(60, 200, size=(count, 1, 1, 3))
    noise = rng.normal(0, 20, size=(count, 24, 24, 3))
    return list(np.clip(levels + noise, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    baseline_images = pictures(1000, np.random.default_rng(0))
    means = np.stack([image.reshape(-1, 3).mean(axis=0) for image in baseline_images])
    baseline = {channel: means[:, index].tolist() for index, channel in enumerate("rgb")}
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(repo, MODEL, "1", resnet(1), batching=batching, drift_baseline=baseline)
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path_factory.mktemp("cache"),
        log_sample_rate=1.0,
        request_log_file=tmp_path_factory.mktemp("logs") / "requests.jsonl",
        # "Within 300 requests" counts images: KS tests by count, not held back to one a second.
        drift_test_min_interval_s=0,
    )
    running = start(settings)
    assert running.wait_ready(120)
    yield running
    running.stop(grace=5)


def send(c: triton.InferenceServerClient, x: np.ndarray, headers: dict[str, str] | None = None) -> None:
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    c.infer(MODEL, [given], headers=headers)


def scrape(server: RunningServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def alarm(server: RunningServer) -> float:
    values = [v for labels, v in scrape(server).get("sluicegate_feature_drift_alarm", []) if labels["model"] == MODEL]
    return values[0] if values else 0.0


def settle(server: RunningServer) -> None:
    """Let the drift thread finish the KS tests already handed to it."""
    assert server.flush_telemetry(30)


def test_drift_stays_quiet_in_distribution_then_fires_on_a_dark_stream(watched: RunningServer) -> None:
    c = triton.InferenceServerClient(f"127.0.0.1:{watched.grpc_port}")
    rng = np.random.default_rng(1)
    for chunk in range(50):  # 5,000 in-distribution requests, one image each
        for image in preprocess(pictures(100, rng), SPEC):
            send(c, image[None])
        settle(watched)
        assert alarm(watched) == 0, f"false alarm after {100 * (chunk + 1)} in-distribution requests"
    dark = preprocess([np.zeros((24, 24, 3), dtype=np.uint8)], SPEC)
    fired_after = None
    for count in range(1, 301):
        send(c, dark)
        if count % 10 == 0:
            settle(watched)
            if alarm(watched) == 1:
                fired_after = count
                break
    assert fired_after is not None, "no drift alarm within 300 requests of an all-dark stream"
    metrics = scrape(watched)
    ks = {labels["feature"]: v for labels, v in metrics["sluicegate_feature_drift_ks_statistic"]}
    assert set(ks) == {"r", "g", "b"} and max(ks.values()) > 0.15
    for name in (
        "sluicegate_queue_duration_seconds_bucket",
        "sluicegate_batch_size_bucket",
        "sluicegate_output_entropy_bits_bucket",
    ):
        assert name in metrics, name
    requests = sum(v for labels, v in metrics["sluicegate_inference_requests_total"] if labels["code"] == "OK")
    assert requests >= 5000 + fired_after
    assert all(labels["le"] for labels, _ in metrics["sluicegate_inference_request_duration_seconds_bucket"])
    assert "sluicegate_gpu_memory_used_bytes" not in metrics  # no GPU here: absent, not zero


def test_request_logs_are_json_with_every_field_and_the_callers_trace_id(watched: RunningServer) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    c = triton.InferenceServerClient(f"127.0.0.1:{watched.grpc_port}")
    x = preprocess(pictures(2, np.random.default_rng(3)), SPEC)
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    c.infer(MODEL, [given], request_id="traced-1", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert watched.settings.request_log_file is not None
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while not records and time.monotonic() < deadline:
        # Records are written on the telemetry thread, after the answer; a lane queues its batch's records
        # just after answering them, so a flush right after the answer can come first (CI, once).
        assert watched.flush_telemetry(30)
        text = watched.settings.request_log_file.read_text()
        records = [json.loads(line) for line in text.splitlines() if '"traced-1"' in line]
        time.sleep(0 if records else 0.05)
    assert len(records) == 1
    record = records[0]
    assert list(record) == [*ENVELOPE, *REQUEST_FIELDS] and record["logger"] == REQUEST_LOGGER
    assert record["model_name"] == MODEL and record["model_version"] == "1" and record["status"] == "OK"
    assert record["batch_size"] == 2 and record["runtime"] == "onnxruntime"
    assert record["abnormal_flag"] is (alarm(watched) == 1)  # flagged while the drift alarm is on
    assert record["trace_id"] == trace_id
    assert record["input_digest"] == input_digest([x]) and 0 < record["output_confidence"] <= 1
    assert isinstance(record["inference_time_ms"], float)
    assert not any(key in record for key in ("inputs", "data", "raw_input_contents"))


def test_a_real_prometheus_scrapes_the_server_and_answers_a_p95_query(watched: RunningServer, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sluicegate-serving\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{watched.http_port}']\n"
    )
    binary = "/usr/bin/prometheus"
    assert Path(binary).exists(), "the prometheus server comes from Debian: run `bash scripts/system-deps.sh`"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Prometheus answers queries with a plain-text 503 until its TSDB is loaded (seconds on a busy machine).
        wait_prometheus_ready(f"http://127.0.0.1:{port}", proc, tmp_path / "prometheus.log")
        c = triton.InferenceServerClient(f"127.0.0.1:{watched.grpc_port}")
        x = preprocess(pictures(1, np.random.default_rng(4)), SPEC)
        query = (
            "histogram_quantile(0.95, sum by (le) (rate(sluicegate_inference_request_duration_seconds_bucket[20s])))"
        )
        deadline, value = time.monotonic() + 90, None
        while time.monotonic() < deadline and value is None:
            for _ in range(20):
                send(c, x)
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5).json()
            except (httpx.HTTPError, ValueError):  # ValueError: a non-JSON answer (not ready, overloaded)
                answer = {}
            result = answer.get("data", {}).get("result", [])
            if result and result[0]["value"][1] not in ("NaN", "+Inf"):
                value = float(result[0]["value"][1])
            time.sleep(1)
        assert value is not None, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert 0 < value < 1.0  # seconds: a small model answers well under a second
    finally:
        proc.terminate()
        proc.wait(15)


def test_telemetry_off_keeps_request_metrics_only(watched: RunningServer, tmp_path: Path) -> None:
    """The switch the overhead benchmark compares against: no monitors, spans or request logs."""
    settings = ServingSettings(
        repository=watched.settings.repository, grpc_port=0, http_port=0, cache_dir=tmp_path, telemetry=False
    )
    bare = start(settings)
    try:
        assert bare.wait_ready(120)
        c = triton.InferenceServerClient(f"127.0.0.1:{bare.grpc_port}")
        for image in preprocess(pictures(20, np.random.default_rng(5)), SPEC):
            send(c, image[None])
        metrics = scrape(bare)
        ok = [v for labels, v in metrics["sluicegate_inference_requests_total"] if labels["code"] == "OK"]
        assert ok == [20.0]
        assert (
            "sluicegate_feature_drift_alarm" not in metrics and "sluicegate_output_entropy_bits_bucket" not in metrics
        )
        assert bare.dataplane.telemetry is None
    finally:
        bare.stop(grace=2)


def test_spans_of_a_real_request_nest_under_the_callers_trace(watched: RunningServer, tmp_path: Path) -> None:
    """With an exporter, a ModelInfer over gRPC makes request > {queue, runtime, postprocess}, all in the
    caller's trace, the request span a child of the caller's span; the log line carries the same trace."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from serving.observability.tracing import setup_tracing

    exporter = InMemorySpanExporter()
    settings = ServingSettings(repository=watched.settings.repository, grpc_port=0, http_port=0, cache_dir=tmp_path)
    traced = start(settings, tracer_provider=setup_tracing("memory", span_exporter=exporter))
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        assert traced.wait_ready(120)
        c = triton.InferenceServerClient(f"127.0.0.1:{traced.grpc_port}")
        x = preprocess(pictures(1, np.random.default_rng(6)), SPEC)
        send(c, x, headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        assert traced.flush_telemetry(30)
    finally:
        traced.stop(grace=2)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {"ModelInfer", "queue", "runtime", "postprocess"} <= set(spans)
    request = spans["ModelInfer"]
    assert request.kind is SpanKind.SERVER and request.parent is not None
    assert format(request.parent.span_id, "016x") == parent
    for name in ("queue", "runtime", "postprocess"):
        span = spans[name]
        assert format(span.context.trace_id, "032x") == trace_id
        assert span.parent is not None and span.parent.span_id == request.context.span_id, name
    assert spans["queue"].end_time <= spans["runtime"].start_time <= spans["runtime"].end_time
    assert spans["runtime"].end_time <= spans["postprocess"].start_time <= request.end_time
    assert spans["runtime"].attributes["sluicegate.runtime"] == "onnxruntime"
