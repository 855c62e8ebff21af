"""No password of the MLflow tracking URI leaves the server: not in its log, not in the status a
RepositoryModelLoad client gets, not in RepositoryIndex's reasons, not in /metrics. The tracking server
is a port nobody listens on, so every load fails and says why, masked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from tests.fixtures.services import free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "Planted-Pa55"
TOKEN = "secrets-admin-token"


@dataclass
class Unready:
    """``python -m serving`` that can never become ready (tests/serving/process.py waits for ready)."""

    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Unready]:
    grpc_port, http_port, mlflow_port = free_port(), free_port(), free_port()
    settings = {
        "MLFLOW_TRACKING_URI": f"http://sg:{PASSWORD}@127.0.0.1:{mlflow_port}",
        "ADMIN_TOKEN": TOKEN,
        "CACHE_DIR": str(tmp_path / "cache"),
        "SHUTDOWN_DELAY_S": "0",
    }
    env = {**os.environ, **{f"SLUICEGATE_SERVING__{k}": v for k, v in settings.items()}}
    log = tmp_path / "server.log"
    args = [sys.executable, "-m", "serving", "--repo", "models:/pcb@champion"]
    args += ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    server = Unready(proc, grpc_port, http_port, log)
    try:
        deadline = time.monotonic() + 60
        while "ready: False" not in server.text():  # the loader gave up on the repository
            assert proc.poll() is None and time.monotonic() < deadline, server.text()[-3000:]
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_tracking_uri_password_never_leaves_the_server(server: Unready) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as failed:
            stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="pcb"),
                timeout=60,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
    details = failed.value.details() or ""
    reasons = " | ".join(f"{m.name}/{m.version} {m.state}: {m.reason}" for m in index.models)
    metrics = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10).text
    log = server.text()
    for where, text in (("load error", details), ("index", reasons), ("metrics", metrics), ("log", log)):
        assert PASSWORD not in text, f"{where} shows the password: {text[-2000:]}"
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
    # Where the URL is shown, it is shown masked: the reader still learns which server and user.
    assert "http://sg:***@127.0.0.1" in details, details
    assert "http://sg:***@127.0.0.1" in reasons, reasons
    assert "http://sg:***@127.0.0.1" in log
