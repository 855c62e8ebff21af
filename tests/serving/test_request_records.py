"""Every request of a loaded ``python -m serving`` is recorded and can be found by ``find_request`` (what
``sluicegate lineage REQUEST_ID`` reads), once, with its model, version and input digest; with a tiny
bound, records are dropped and counted instead of blocking answers."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash

from serving.observability.logs import REQUEST_LOGGER
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc
from tasks.lineage.request_logs import find_request
from tests.fixtures.models import resnet, write_model_version
from tests.serving.process import ServerProcess

MODEL = "recorded"
SHAPE = (1, 3, 32, 32)
IN_FLIGHT = 32
REQUESTS = 3000


@pytest.fixture(scope="module")
def one_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(root, MODEL, "1", resnet(7), batching=batching)
    return root


def payload(index: int) -> bytes:
    """Request ``index``'s input: distinct bytes per request, so a digest mixed up between requests shows."""
    return np.random.default_rng(index).standard_normal(SHAPE).astype("<f4").tobytes()


def load(server: ServerProcess, count: int) -> dict[str, str]:
    """``count`` ModelInfer calls, ``IN_FLIGHT`` at a time, each with its own id; every answer must be OK.
    Returns id -> the digest expected in its record (XXH3-128 of its raw input bytes)."""
    expected = {f"load-{index:05d}": "xxh3-128:" + xxhash.xxh3_128_hexdigest(payload(index)) for index in range(count)}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]

        def call(index: int) -> str:
            request = pb.ModelInferRequest(model_name=MODEL, id=f"load-{index:05d}")
            request.inputs.add(name="input", datatype="FP32", shape=SHAPE)
            request.raw_input_contents.append(payload(index))
            answer = stub.ModelInfer(request, timeout=60)  # a blocked answer fails here, not a hung test
            return str(answer.id)

        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            answered = list(pool.map(call, range(count)))
    assert answered == list(expected)
    return expected


def dropped(server: ServerProcess) -> float:
    text = server.http("GET", "/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sluicegate_request_records_dropped_total")
    ]
    assert values, "sluicegate_request_records_dropped_total is not exported"
    return sum(values)


def stopped(server: ServerProcess) -> Iterator[dict[str, Any]]:
    """SIGTERM (the records still queued are written on the way out), then every request record logged."""
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0, server.log_text()[-3000:]
    for line in server.log_text().splitlines():
        if f'"logger":"{REQUEST_LOGGER}"' in line:
            yield json.loads(line)


def test_every_request_of_a_loaded_server_is_found_once_with_its_digest(one_model: Path, tmp_path: Path) -> None:
    server = ServerProcess(one_model, tmp_path, {"SHUTDOWN_DELAY_S": "0"})  # defaults: every request recorded
    try:
        expected = load(server, REQUESTS)
        assert dropped(server) == 0
        records = list(stopped(server))
    finally:
        server.stop()
    by_id = Counter(record["request_id"] for record in records)
    assert {request_id: by_id[request_id] for request_id in expected} == dict.fromkeys(expected, 1)
    for record in records:
        if record["request_id"] in expected:
            assert (record["model_name"], record["model_version"], record["status"]) == (MODEL, "1", "OK")
            assert record["input_digest"] == expected[record["request_id"]]
            assert record["batch_size"] == 1 and 0 < record["output_confidence"] <= 1
    # What `sluicegate lineage REQUEST_ID` runs, on the server's own output (a sample: each search reads it all).
    for request_id in list(expected)[:: REQUESTS // 30]:
        search = find_request(request_id, [server.log])
        assert len(search.matches) == 1, request_id
        found = search.matches[0]
        assert (found.model_name, found.model_version, found.input_digest) == (MODEL, "1", expected[request_id])


def test_past_a_tiny_bound_records_are_dropped_and_counted_and_answers_never_wait(
    one_model: Path, tmp_path: Path
) -> None:
    server = ServerProcess(one_model, tmp_path, {"SHUTDOWN_DELAY_S": "0", "TELEMETRY_MAX_PENDING": "1"})
    try:
        before = dropped(server)  # the start-up warm-up's requests may have been dropped already
        expected = load(server, 600)  # every answer OK within its deadline: recording never held one up
        lost = dropped(server) - before
        records = [r for r in stopped(server) if r["request_id"] in expected]
    finally:
        server.stop()
    assert lost > 0
    # Each request is either written once or counted as dropped: nothing is lost silently.
    assert len(records) == len({r["request_id"] for r in records})
    assert len(records) + lost == len(expected)
