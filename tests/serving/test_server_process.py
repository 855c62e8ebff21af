"""The server as its own process (`python -m serving`): drain on SIGTERM, overload answered with
RESOURCE_EXHAUSTED and bounded memory, recovery when the load stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.fixtures.services import free_port
from tests.serving.conftest import batch

ROOT = Path(__file__).resolve().parents[2]


class Process:
    def __init__(self, repo: Path, tmp: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log = tmp / "server.log"
        env = {
            **os.environ,
            "SLUICEGATE_SERVING__CACHE_DIR": str(tmp / "cache"),
            "SLUICEGATE_SERVING__PROBE_INTERVAL_S": "0",
        }
        args = [sys.executable, "-m", "serving", "--repo", str(repo), "--grpc-port", str(self.grpc_port)]
        args += ["--http-port", str(self.http_port)]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("server did not become ready:\n" + self.log.read_text()[-3000:])

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")


@pytest.fixture
def process(repo: Path, tmp_path: Path) -> Iterator[Process]:
    server = Process(repo, tmp_path)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def slow_infer(c: triton.InferenceServerClient, x: np.ndarray) -> str:
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    try:
        c.infer("slow", [given])
        return "OK"
    except InferenceServerException as exc:
        return str(exc.status())


def test_sigterm_drains_in_flight_requests_then_exits(process: Process) -> None:
    c = process.client()
    x = batch(8, seed=1)
    with ThreadPoolExecutor(4) as pool:  # one running and three queued: within the queue of 4
        pending = [pool.submit(slow_infer, c, x) for _ in range(4)]
        time.sleep(0.3)  # the requests are queued or running
        process.proc.send_signal(signal.SIGTERM)
        outcomes = [p.result() for p in pending]
    assert outcomes == ["OK"] * 4, outcomes  # everything in flight when SIGTERM came was answered
    assert process.proc.wait(30) == 0
    assert "draining" in process.log.read_text()


def test_overload_answers_resource_exhausted_with_bounded_memory_and_recovers(process: Process) -> None:
    c = process.client()
    x = batch(8, seed=2)
    rss = psutil.Process(process.proc.pid)
    before = rss.memory_info().rss
    with ThreadPoolExecutor(48) as pool:
        outcomes = list(pool.map(lambda _: slow_infer(c, x), range(240)))
    grown = rss.memory_info().rss - before
    assert outcomes.count("OK") > 0
    assert outcomes.count("StatusCode.RESOURCE_EXHAUSTED") > 100, set(outcomes)  # queue of 4 at ~8x capacity
    assert set(outcomes) <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}
    assert grown < 200 * 2**20, grown  # the queue is bounded: no growth with the number of waiting clients
    assert slow_infer(c, x) == "OK"  # recovered once the load stopped
    assert c.is_server_ready()
    with pytest.raises(grpc.RpcError):
        grpc.insecure_channel(f"127.0.0.1:{process.grpc_port}").unary_unary(
            "/inference.GRPCInferenceService/ModelInfer"
        )(b"\xff\x00garbage", timeout=5)
