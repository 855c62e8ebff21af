"""Shutdown the way a load balancer needs it (`python -m serving` as its own process): on SIGTERM the
server reports not ready at once, keeps answering for ``SHUTDOWN_DELAY_S`` while the balancer takes it
out, then stops accepting, drains and exits 0. A client sending throughout sees no failure among the
requests it sent before the delay ended."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fixtures.models import resnet, write_model_version
from tests.serving.process import ServerProcess

DELAY_S = 3.0
# Requests sent this close to the end of the delay may meet the closed port: not counted either way.
BOUNDARY_S = 0.25
# Generous for two shared cores: the views must drop well inside the delay, not at its end.
NOT_READY_WITHIN_S = 1.0


@dataclass
class Traffic:
    """Threads sending single-image requests until told to stop; (sent, finished, ok) per request."""

    target: str
    sent: list[tuple[float, float, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, seed: int) -> None:
        client = triton.InferenceServerClient(self.target)
        x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
        given = triton.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                client.infer("pcb", [given], client_timeout=10)
                ok = True
            except Exception:
                ok = False
            self.sent.append((began, time.monotonic(), ok))
            if not ok:
                time.sleep(0.01)  # the port is closed: no busy loop
        client.close()


def not_ready_at(process: ServerProcess, stop: threading.Event) -> dict[str, float]:
    """When each readiness view was first seen not ready (polled every 20 ms)."""
    seen: dict[str, float] = {}
    with grpc.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set() and len(seen) < 2:
            try:
                if "/health/ready" not in seen and process.http("GET", "/health/ready", timeout=2).status_code == 503:
                    seen["/health/ready"] = time.monotonic()
            except httpx.HTTPError:
                pass
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if "health" not in seen and status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    seen["health"] = time.monotonic()
            except grpc.RpcError:
                pass
            time.sleep(0.02)
    return seen


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_model_version(root, "pcb", "1", resnet(1), batching={"max_batch_size": 8, "max_queue_delay_us": 0})
    return root


def test_sigterm_keeps_serving_through_the_delay_while_not_ready_then_drains(repo: Path, tmp_path: Path) -> None:
    process = ServerProcess(repo, tmp_path, {"SHUTDOWN_DELAY_S": str(DELAY_S), "TELEMETRY": "false"})
    try:
        traffic = Traffic(f"127.0.0.1:{process.grpc_port}")
        senders = [threading.Thread(target=traffic.run, args=(seed,), daemon=True) for seed in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(1.0)  # steady traffic before the signal
        watching = threading.Event()
        views: dict[str, float] = {}
        watcher = threading.Thread(target=lambda: views.update(not_ready_at(process, watching)), daemon=True)
        watcher.start()
        signalled = time.monotonic()
        process.proc.send_signal(signal.SIGTERM)
        code = process.proc.wait(60)
        watching.set()
        traffic.stop.set()
        for thread in (*senders, watcher):
            thread.join(30)
    finally:
        process.stop()
    log = process.log_text()
    assert code == 0, log[-3000:]
    delay_end = signalled + DELAY_S - BOUNDARY_S
    before = [ok for began, _, ok in traffic.sent if began < delay_end]
    during = [ok for began, _, ok in traffic.sent if signalled <= began < delay_end]
    print(f"sent before the delay ended: {len(before)} ({len(during)} during the delay), failed: {before.count(False)}")
    assert before.count(False) == 0, f"{before.count(False)} of {len(before)} requests failed before the delay ended"
    assert len(during) > 10, "the traffic did not go on through the delay: the test checked nothing"
    assert set(views) == {"/health/ready", "health"}, views
    assert all(at - signalled < NOT_READY_WITHIN_S for at in views.values()), {
        k: round(at - signalled, 3) for k, at in views.items()
    }
    # Not ready, yet answering: requests sent after both views dropped still succeeded.
    dropped = max(views.values())
    after_drop = [ok for began, _, ok in traffic.sent if dropped <= began < delay_end]
    assert after_drop and all(after_drop)
    assert "stopping" in log and "draining" in log
