"""The rollout's Prometheus side with the real binaries (Debian packages, installed by the test set-up):
PrometheusSource reads each version's traffic from a Prometheus scraping a real model server serving two
versions, custom PromQL checks included; a rollback posts an alert a real Alertmanager then lists."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tasks.rollout.config import alertmanager_notifier
from tasks.rollout.metrics import PrometheusSource, histogram_quantile
from tasks.rollout.plan import CustomCheck
from tests.fixtures.models import SPEC, resnet, write_model_version
from tests.fixtures.services import free_port, wait_prometheus_ready

MODEL = "pcb"
TOKEN = "prometheus-test-token"


def binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    assert found, f"{name} comes from Debian: run `bash scripts/system-deps.sh`"
    return found


@pytest.fixture
def two_versions(tmp_path: Path) -> Iterator[RunningServer]:
    repo = tmp_path / "repo"
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(repo, MODEL, "1", resnet(1), batching=batching)
    write_model_version(repo, MODEL, "2", resnet(2), batching=batching)
    server = start(
        ServingSettings(repository=str(repo), grpc_port=0, http_port=0, cache_dir=tmp_path / "c", admin_token=TOKEN)
    )
    try:
        assert server.wait_ready(120)
        server.dataplane.set_weights(MODEL, {"1": 70, "2": 30})
        yield server
    finally:
        server.stop(grace=2)


@pytest.fixture
def prometheus(two_versions: RunningServer, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: serving\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{two_versions.http_port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    argv = [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    proc = subprocess.Popen([*argv, f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_prometheus_ready(url, proc, tmp_path / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def test_prometheus_source_reads_each_versions_traffic(two_versions: RunningServer, prometheus: str) -> None:
    source = PrometheusSource(prometheus, min_window_s=5)
    client = triton.InferenceServerClient(f"127.0.0.1:{two_versions.grpc_port}")
    x = np.zeros((1, 3, SPEC.height, SPEC.width), dtype=np.float32)
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    # As in a real rollout, both versions' series exist in Prometheus before the window opens
    # (increase() cannot count what happened before a series' first scrape).
    for _ in range(40):
        client.infer(MODEL, [given])
    for _ in range(60):
        query = {"query": f'count(sluicegate_inference_requests_total{{model="{MODEL}"}})'}
        result = httpx.get(f"{prometheus}/api/v1/query", params=query, timeout=5).json()["data"]["result"]
        if result and float(result[0]["value"][1]) >= 2:
            break
        time.sleep(0.5)
    time.sleep(2.5)  # two more scrapes: the last warm-up request is in
    base = {v: _total(prometheus, v) for v in ("1", "2")}
    since = source.begin(MODEL)
    served: Counter[str] = Counter()
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        served[client.infer(MODEL, [given]).get_response().model_version] += 1
    checks = (
        CustomCheck("ok_total", 'sum(sluicegate_inference_requests_total{{model="{model}",version="{version}"}})'),
    )
    readings = {}
    for _ in range(30):  # until Prometheus has scraped the last requests
        readings = {v: source.read(MODEL, v, since, checks) for v in ("1", "2")}
        if all(readings[v].custom.get("ok_total", 0) - base[v] == served[v] for v in ("1", "2")):
            break
        time.sleep(1)
    for version in ("1", "2"):
        reading = readings[version]
        assert reading.custom["ok_total"] - base[version] == served[version], (version, reading, served)
        # increase() extrapolates over the window, so it is near, not equal to, what was sent.
        assert 0.6 * served[version] <= reading.requests <= 1.4 * served[version], (version, reading, served)
        assert reading.errors == 0 and reading.p95_s is not None and 0 < reading.p95_s < 0.5
        # The buckets the significance test counts from: the same histogram Prometheus took the p95 from.
        buckets = reading.latency_buckets
        assert buckets[-1][0] == math.inf and buckets[-1][1] == pytest.approx(reading.requests)
        assert histogram_quantile(0.95, buckets) == pytest.approx(reading.p95_s)
    assert served["1"] > served["2"] > 0  # the 70/30 split reached both


def _total(prometheus: str, version: str) -> float:
    query = {"query": f'sum(sluicegate_inference_requests_total{{model="{MODEL}",version="{version}"}})'}
    result = httpx.get(f"{prometheus}/api/v1/query", params=query, timeout=5).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else 0.0


def test_a_rollback_alert_reaches_a_real_alertmanager(tmp_path: Path) -> None:
    port, cluster = free_port(), free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text("route:\n  receiver: nobody\nreceivers:\n  - name: nobody\n")
    argv = [
        binary("prometheus-alertmanager"),
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--cluster.listen-address=127.0.0.1:{cluster}",
    ]
    log = (tmp_path / "alertmanager.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_prometheus_ready(url, proc, tmp_path / "alertmanager.log", timeout=30)
        notify = alertmanager_notifier(url)
        assert notify is not None and alertmanager_notifier(None) is None
        notify(MODEL, "2", "step 0 (5%) failed: canary error rate 3.00%")
        alerts = httpx.get(f"{url}/api/v2/alerts", timeout=5).json()
        assert [a["labels"]["alertname"] for a in alerts] == ["SluicegateRollback"]
        assert alerts[0]["labels"]["model"] == MODEL and alerts[0]["labels"]["version"] == "2"
        assert "error rate" in alerts[0]["annotations"]["description"]
    finally:
        proc.terminate()
        proc.wait(15)
