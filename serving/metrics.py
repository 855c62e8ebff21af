"""Prometheus metrics of the server, on one registry per server (so several servers in one process, as in
tests, never share counters). Names carry their units."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From 100 microseconds: a small model answers in well under a millisecond.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sluicegate_inference_requests",
            "Inference requests by model, version and gRPC status code.",
            ["model", "version", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sluicegate_inference_request_duration_seconds",
            "Time from receiving an inference request to answering it.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.fallback_level = Gauge(
            "sluicegate_runtime_fallback_level",
            "Runtime level a model version runs on (0: the best configured; higher: fallen back).",
            ["model", "version", "runtime"],
            registry=self.registry,
        )
        self.ready = Gauge(
            "sluicegate_server_ready", "1 when every configured model is loaded.", registry=self.registry
        )

    def observe(self, model: str, version: str, code: str, seconds: float) -> None:
        self.requests.labels(model, version, code).inc()
        if code == "OK":
            self.latency.labels(model, version).observe(seconds)

    def set_level(self, model: str, version: str, runtime: str, level: int) -> None:
        # One series per version: drop the old runtime's label set so the gauge shows only the current one.
        stale = [
            sample.labels["runtime"]
            for metric in self.fallback_level.collect()
            for sample in metric.samples
            if sample.labels.get("model") == model and sample.labels.get("version") == version
        ]
        for runtime_name in stale:
            self.fallback_level.remove(model, version, runtime_name)
        self.fallback_level.labels(model, version, runtime).set(level)
