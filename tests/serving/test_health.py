"""Readiness has four views: gRPC health (the whole server "" and the inference service by name),
ServerReady, ``/health/ready`` and the ``sluicegate_server_ready`` gauge. They must agree after every
transition: start-up, unload, a later load, a server that starts on an empty repository and gets its
first model later, and shutdown (not ready at once while the ports still answer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures.models import resnet, write_model_version

TOKEN = "health-admin-token"
MODEL = "pcb"
BATCHING = {"max_batch_size": 4, "max_queue_delay_us": 0, "max_queue_size": 64}
SERVICES = ("", "inference.GRPCInferenceService")


def serve(repo: Path, cache: Path) -> RunningServer:
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=cache,
        admin_token=TOKEN,
        probe_interval_s=0,
        telemetry=False,
        shutdown_delay_s=0,
    )
    return start(settings)


def views(server: RunningServer) -> dict[str, bool]:
    """Every readiness view of ``server``, read over its real ports."""
    target = f"127.0.0.1:{server.grpc_port}"
    seen: dict[str, bool] = {}
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in SERVICES:
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            seen[f"health[{service!r}]"] = status == health_pb2.HealthCheckResponse.SERVING
        inference = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        seen["ServerReady"] = inference.ServerReady(pb.ServerReadyRequest(), timeout=5).ready
    client = triton.InferenceServerClient(target)
    try:
        seen["tritonclient.is_server_ready"] = client.is_server_ready()
    finally:
        client.close()
    base = f"http://127.0.0.1:{server.http_port}"
    seen["/health/ready"] = httpx.get(f"{base}/health/ready", timeout=5).status_code == 200
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith("sluicegate_server_ready "):
            seen["sluicegate_server_ready"] = float(line.split()[1]) == 1.0
    return seen


def assert_views(server: RunningServer, ready: bool) -> None:
    seen = views(server)
    assert len(seen) == 6, seen
    assert seen == dict.fromkeys(seen, ready), seen


def admin(server: RunningServer, call: str, model: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        if call == "load":
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=model), timeout=120, metadata=metadata)
        else:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=model), timeout=60, metadata=metadata)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("health-repo")
    write_model_version(root, MODEL, "1", resnet(1), batching=BATCHING)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Own server: these tests unload its model and finally shut it down."""
    running = serve(repo, tmp_path_factory.mktemp("cache"))
    assert running.wait_ready(120), running.dataplane.index()
    yield running
    running.stop(grace=5, delay=0)


def test_every_view_is_ready_after_start_up(server: RunningServer) -> None:
    assert_views(server, True)


def test_unload_drops_every_view_and_a_later_load_brings_them_back(server: RunningServer) -> None:
    admin(server, "unload", MODEL)
    assert_views(server, False)
    admin(server, "load", MODEL)
    assert_views(server, True)


def test_triton_client_health_calls_agree(server: RunningServer) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
        admin(server, "unload", MODEL)
        assert client.is_server_live() and not client.is_server_ready() and not client.is_model_ready(MODEL)
        admin(server, "load", MODEL)
        assert client.is_server_ready() and client.is_model_ready(MODEL, "1")
    finally:
        client.close()


def test_a_server_on_an_empty_repository_becomes_ready_when_its_first_model_loads(tmp_path: Path) -> None:
    """The demo's order: the server starts before any champion exists and loads it later."""
    empty = tmp_path / "repo"
    empty.mkdir()
    running = serve(empty, tmp_path / "cache")
    try:
        assert not running.wait_ready(60)
        assert_views(running, False)
        write_model_version(empty, MODEL, "1", resnet(1), batching=BATCHING)
        admin(running, "load", MODEL)
        assert_views(running, True)
    finally:
        running.stop(grace=5, delay=0)


def test_shutdown_drops_every_view_at_once_while_the_ports_still_answer(server: RunningServer) -> None:
    """Last in the module: it stops the shared server."""
    assert_views(server, True)
    stopping = threading.Thread(target=server.stop, kwargs={"grace": 5, "delay": 3.0})
    stopping.start()
    try:
        deadline = time.monotonic() + 2.0
        while server.dataplane.ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert_views(server, False)  # every view read over the ports, which are still open in the delay
        # A load during the delay must not bring health back: nothing routes to a stopping server.
        admin(server, "load", MODEL)
        assert_views(server, False)
    finally:
        stopping.join(30)
    assert not stopping.is_alive()
