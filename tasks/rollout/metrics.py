"""Where the rollout's analysis reads each version's traffic: one ``MetricsSource`` interface, two sources.

- ``PrometheusSource``: PromQL over HTTP against the Prometheus that scrapes the serving pods (the
  Kubernetes case, and any deployment with a Prometheus): ``increase()`` of the request counters and
  ``histogram_quantile`` of the latency buckets over the analysis window, per ``version`` label; also
  evaluates the plan's custom PromQL checks.
- ``ScrapeSource``: reads the servers' ``/metrics`` directly and subtracts a snapshot taken when the
  window began (the local case: no Prometheus needed). It cannot run PromQL, so a plan with custom
  checks needs Prometheus.

Both return ``VersionMetrics`` for one version over the window that began at ``begin()``.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sluicegate.errors import SluicegateError
from tasks.rollout.plan import CustomCheck, VersionMetrics

REQUESTS = "sluicegate_inference_requests_total"
LATENCY_BUCKETS = "sluicegate_inference_request_duration_seconds_bucket"
COLLAPSE = "sluicegate_output_entropy_collapse"


class MetricsError(SluicegateError):
    """The metrics could not be read; the message names the endpoint and the fix."""


class MetricsSource(Protocol):
    def begin(self, model: str) -> Any:
        """Mark the start of an analysis window (a time, or a snapshot of the counters)."""
        ...

    def read(self, model: str, version: str, since: Any, checks: Sequence[CustomCheck] = ()) -> VersionMetrics:
        """One version's traffic since ``since`` (what ``begin`` returned)."""
        ...


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative ``(upper bound, count)`` buckets.

    Hand-written because no library computes it outside Prometheus (prometheus-client only exports):
    linear interpolation inside the bucket where the rank falls, the lowest bucket starting at 0, and a
    rank in the +Inf bucket answered with the highest finite bound, as Prometheus does. None when the
    histogram is empty.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound


@dataclass(frozen=True)
class ScrapeSnapshot:
    """The counters of one model read from the servers' ``/metrics`` at one moment (summed over servers)."""

    requests: dict[tuple[str, str], float] = field(default_factory=dict)  # (version, code) -> count
    buckets: dict[tuple[str, float], float] = field(default_factory=dict)  # (version, le) -> cumulative count
    collapsed: dict[str, bool] = field(default_factory=dict)


class ScrapeSource:
    """The servers' own ``/metrics`` (every URL is scraped and summed), differenced over the window.

    Args:
        urls: The servers' metrics endpoints, e.g. ``http://127.0.0.1:8000/metrics``.
        timeout_s: Per scrape.
        verify: httpx's ``verify=``: an SSL context with the servers' CA (and client certificate) for TLS.
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 5.0, verify: ssl.SSLContext | bool = True) -> None:
        if not urls:
            raise ValueError("ScrapeSource needs at least one /metrics URL")
        self.urls, self.timeout_s = list(urls), timeout_s
        # One client for the source's life: building one per call cost 50-100 ms here (benchmarks).
        self._http = httpx.Client(timeout=timeout_s, verify=verify)

    def begin(self, model: str) -> ScrapeSnapshot:
        return self._scrape(model)

    def read(self, model: str, version: str, since: Any, checks: Sequence[CustomCheck] = ()) -> VersionMetrics:
        if checks:
            names = ", ".join(c.name for c in checks)
            raise MetricsError(f"custom checks ({names}) are PromQL: give the rollout a Prometheus metrics source")
        now, before = self._scrape(model), since
        requests = errors = 0.0
        for (ver, code), count in now.requests.items():
            if ver == version:
                delta = max(0.0, count - before.requests.get((ver, code), 0.0))
                requests += delta
                errors += delta if code != "OK" else 0.0
        buckets = [
            (le, max(0.0, count - before.buckets.get((ver, le), 0.0)))
            for (ver, le), count in now.buckets.items()
            if ver == version
        ]
        return VersionMetrics(
            requests,
            errors,
            histogram_quantile(0.95, buckets),
            now.collapsed.get(version),
            latency_buckets=tuple(sorted(buckets)),
        )

    def _scrape(self, model: str) -> ScrapeSnapshot:
        snapshot = ScrapeSnapshot()
        for url in self.urls:
            try:
                text = self._http.get(url).raise_for_status().text
            except httpx.HTTPError as exc:
                raise MetricsError(f"cannot scrape {url}: {exc}; is the model server running?") from exc
            add_exposition(snapshot, model, text)
        return snapshot


def add_exposition(snapshot: ScrapeSnapshot, model: str, text: str) -> None:
    """Add the samples of ``model`` in one Prometheus text exposition to ``snapshot`` (other models ignored)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("model") != model:
                continue
            version = labels.get("version", "")
            if sample.name == REQUESTS:
                key = (version, labels.get("code", ""))
                snapshot.requests[key] = snapshot.requests.get(key, 0.0) + sample.value
            elif sample.name == LATENCY_BUCKETS:
                bucket = (version, float(labels["le"]))
                snapshot.buckets[bucket] = snapshot.buckets.get(bucket, 0.0) + sample.value
            elif sample.name == COLLAPSE:
                snapshot.collapsed[version] = snapshot.collapsed.get(version, False) or sample.value >= 1


class PrometheusSource:
    """PromQL over Prometheus's HTTP API (``/api/v1/query``), per ``model``/``version`` label.

    Args:
        url: Prometheus, e.g. ``http://prometheus.monitoring:9090``.
        timeout_s: Per query.
        min_window_s: Shortest window queried (a range shorter than two scrape intervals has no
            ``increase``); with the PodMonitor's 15 s interval, 30 s.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0, min_window_s: float = 30.0) -> None:
        self.url, self.timeout_s, self.min_window_s = url.rstrip("/"), timeout_s, min_window_s
        self._http = httpx.Client(timeout=timeout_s)

    def begin(self, model: str) -> float:
        return time.time()

    def read(self, model: str, version: str, since: Any, checks: Sequence[CustomCheck] = ()) -> VersionMetrics:
        # Every query of one reading is evaluated at the same instant: increase() extrapolates to the
        # evaluation time, so queries a few ms apart disagree (the p95 would not match the buckets
        # the significance test counts, nor errors the requests).
        at = time.time()
        window = f"{max(self.min_window_s, at - float(since)):.0f}s"
        selector = f'model="{_escape(model)}",version="{_escape(version)}"'
        requests = self._scalar(f"sum(increase({REQUESTS}{{{selector}}}[{window}]))", at) or 0.0
        errors = self._scalar(f'sum(increase({REQUESTS}{{{selector},code!="OK"}}[{window}]))', at) or 0.0
        by_le = f"sum by (le) (increase({LATENCY_BUCKETS}{{{selector}}}[{window}]))"
        p95 = self._scalar(f"histogram_quantile(0.95, {by_le})", at)
        by_bound = self._vector(by_le, at)
        buckets = tuple(sorted((float(labels["le"]), value) for labels, value in by_bound if "le" in labels))
        collapsed = self._scalar(f"max({COLLAPSE}{{{selector}}})", at)
        custom = {}
        for check in checks:
            value = self._scalar(check.query.format(model=model, version=version, window=window), at)
            if value is not None:
                custom[check.name] = value
        return VersionMetrics(
            requests,
            errors,
            p95 if p95 is not None and math.isfinite(p95) else None,
            None if collapsed is None else collapsed >= 1,
            custom,
            latency_buckets=buckets,
        )

    def _scalar(self, query: str, at: float) -> float | None:
        """The query's single value at ``at`` (summed over series); None when empty or NaN."""
        values = [value for _, value in self._vector(query, at)]
        return sum(values) if values else None

    def _vector(self, query: str, at: float) -> list[tuple[dict[str, str], float]]:
        """The query's series at ``at`` (Unix seconds) as (labels, value), NaNs left out."""
        try:
            response = self._http.get(f"{self.url}/api/v1/query", params={"query": query, "time": f"{at:.3f}"})
            body: Mapping[str, Any] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise MetricsError(f"Prometheus at {self.url} did not answer {query!r}: {exc}") from exc
        if body.get("status") != "success":
            raise MetricsError(f"Prometheus refused {query!r}: {body.get('error', body)}")
        series = [(item.get("metric", {}), float(item["value"][1])) for item in body.get("data", {}).get("result", [])]
        return [(labels, value) for labels, value in series if not math.isnan(value)]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
