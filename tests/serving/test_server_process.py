"""The server as its own process (`python -m serving`): drain on SIGTERM, overload answered with
RESOURCE_EXHAUSTED and bounded memory, recovery when the load stops."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.serving.conftest import batch
from tests.serving.process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def process(repo: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(repo, tmp_path, {"SHUTDOWN_DELAY_S": "0"})  # the delay has its own test (test_shutdown.py)
    yield server
    server.stop()


def slow_infer(c: triton.InferenceServerClient, x: np.ndarray) -> str:
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    try:
        c.infer("slow", [given])
        return "OK"
    except InferenceServerException as exc:
        return str(exc.status())


def test_sigterm_drains_in_flight_requests_then_exits(process: ServerProcess) -> None:
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


def test_overload_answers_resource_exhausted_with_bounded_memory_and_recovers(process: ServerProcess) -> None:
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
