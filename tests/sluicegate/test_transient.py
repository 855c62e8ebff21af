"""The transient-failure classifier, on exceptions real clients raise against real (or absent) servers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
from sqlalchemy import create_engine, text

from sluicegate.errors import ConfigError, DatasetError, GateFailed, SchemaOutdated, StorageError, StoreUnavailable
from sluicegate.metadata import MetadataStore
from sluicegate.transient import is_transient
from tests.fixtures.postgres import PostgresCluster
from tests.fixtures.services import LOOPBACK, free_port, single_try_s3

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def raised(call: Callable[[], object]) -> BaseException:
    try:
        call()
    except Exception as exc:
        return exc
    pytest.fail(f"{call} did not raise")


def s3(endpoint: str) -> Any:
    return single_try_s3(endpoint, read_timeout=5)


class _Answer(BaseHTTPRequestHandler):
    """Answers every request with the status in its path's first segment (``/503/...``), S3-style body."""

    def _answer(self) -> None:
        status = int(self.path.strip("/").split("/")[0].split("?")[0] or 200)
        body = SLOW_DOWN if status == 503 else b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such run"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/xml" if status == 503 else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = _answer

    def log_message(self, format: str, *args: Any) -> None:  # silence the per-request lines on stderr
        pass


@pytest.fixture(scope="module")
def answering() -> Iterator[str]:
    """A real HTTP server that answers with whatever status the path asks for."""
    server = ThreadingHTTPServer((LOOPBACK, 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed() -> str:
    """A loopback address nobody listens on: connections are refused."""
    return f"http://{LOOPBACK}:{free_port()}"


# S3 through botocore


def test_s3_endpoint_away_is_transient(closed: str) -> None:
    exc = raised(lambda: s3(closed).list_objects_v2(Bucket="sluicegate"))
    assert type(exc).__name__ == "EndpointConnectionError"
    assert is_transient(exc)


def test_s3_missing_key_and_bucket_are_not_transient(moto_url: str) -> None:
    client = s3(moto_url)
    client.create_bucket(Bucket="transient-test")
    missing_key = raised(lambda: client.get_object(Bucket="transient-test", Key="nope"))
    missing_bucket = raised(lambda: client.list_objects_v2(Bucket="no-such-bucket-here"))
    assert type(missing_key).__name__ == "NoSuchKey" and not is_transient(missing_key)
    assert type(missing_bucket).__name__ == "NoSuchBucket" and not is_transient(missing_bucket)


def test_s3_slow_down_is_transient(answering: str) -> None:
    exc = raised(lambda: s3(f"{answering}/503").list_objects_v2(Bucket="sluicegate"))
    assert getattr(exc, "response", {})["Error"]["Code"] == "SlowDown"
    assert is_transient(exc)


def test_s3_client_error_with_4xx_status_is_not_transient(answering: str) -> None:
    exc = raised(lambda: s3(f"{answering}/403").head_bucket(Bucket="sluicegate"))
    assert type(exc).__name__ == "ClientError" and not is_transient(exc)


# MLflow (requests/urllib3 underneath)


def test_mlflow_server_away_is_transient(closed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    exc = raised(lambda: MlflowClient(tracking_uri=closed).get_experiment_by_name("x"))
    # The shape MLflow 3 gives: a plain MlflowException, the requests error only in its context.
    assert isinstance(exc, MlflowException) and "failed with exception" in str(exc)
    assert exc.__cause__ is None and isinstance(exc.__context__, requests.ConnectionError)
    assert is_transient(exc)


def test_mlflow_5xx_after_its_own_retries_is_transient(answering: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    exc = raised(lambda: MlflowClient(tracking_uri=f"{answering}/503").get_experiment_by_name("x"))
    assert is_transient(exc)


def test_mlflow_missing_run_is_not_transient(answering: str) -> None:
    from mlflow import MlflowClient
    from mlflow.exceptions import RestException

    # The server's answer for a run that does not exist (status and body as MLflow's own server sends).
    exc = raised(lambda: MlflowClient(tracking_uri=f"{answering}/404").get_run("0" * 32))
    assert isinstance(exc, RestException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST"
    assert not is_transient(exc)


# httpx, requests, sockets


def test_http_clients_refused_or_timed_out_are_transient(closed: str) -> None:
    assert is_transient(raised(lambda: httpx.get(closed, timeout=2)))
    assert is_transient(raised(lambda: requests.get(closed, timeout=2)))
    with socket.socket() as sock, socket.socket() as silent:
        silent.bind((LOOPBACK, 0))
        silent.listen()  # accepts into the backlog, never answers
        sock.settimeout(0.05)
        sock.connect(silent.getsockname())
        timed_out = raised(lambda: sock.recv(1))
    assert isinstance(timed_out, TimeoutError) and is_transient(timed_out)
    refused = raised(lambda: socket.create_connection((LOOPBACK, free_port()), timeout=2))
    assert isinstance(refused, ConnectionRefusedError) and is_transient(refused)


def test_http_status_errors_transient_only_for_5xx_and_429(answering: str) -> None:
    assert is_transient(raised(lambda: httpx.get(f"{answering}/503").raise_for_status()))
    assert is_transient(raised(lambda: httpx.get(f"{answering}/429").raise_for_status()))
    assert not is_transient(raised(lambda: httpx.get(f"{answering}/404").raise_for_status()))
    assert is_transient(raised(lambda: requests.get(f"{answering}/502", timeout=5).raise_for_status()))
    assert not is_transient(raised(lambda: requests.get(f"{answering}/400", timeout=5).raise_for_status()))


# The metadata store (SQLAlchemy over psycopg)


def test_postgres_away_is_transient_and_the_store_error_says_so() -> None:
    url = f"postgresql+psycopg://u:secret@{LOOPBACK}:{free_port()}/x"
    engine = create_engine(url)
    try:
        direct = raised(engine.connect)
    finally:
        engine.dispose()
    assert type(direct).__name__ == "OperationalError" and is_transient(direct)
    store = MetadataStore(url)
    try:
        wrapped = raised(store.check_schema)
    finally:
        store.dispose()
    assert isinstance(wrapped, StoreUnavailable) and is_transient(wrapped)


def test_a_dropped_postgres_connection_is_transient(postgres_cluster: PostgresCluster) -> None:
    engine = create_engine(postgres_cluster.url("postgres"))  # no pre-ping: the next query meets the drop
    try:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with postgres_cluster.admin() as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            dropped = raised(lambda: conn.execute(text("SELECT 1")))
    finally:
        engine.dispose()
    assert getattr(dropped, "connection_invalidated", False)
    assert is_transient(dropped)


def test_sqlite_schema_and_file_errors_are_not_transient(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'raw.db'}")
    try:
        with engine.connect() as conn:
            missing_table = raised(lambda: conn.execute(text("SELECT * FROM pipeline_runs")))
    finally:
        engine.dispose()
    empty = MetadataStore(f"sqlite:///{tmp_path / 'empty.db'}")
    directory = MetadataStore(f"sqlite:///{tmp_path}")  # a directory, not a file
    try:
        with pytest.raises(SchemaOutdated) as schema, empty.session() as session:
            session.execute(text("SELECT * FROM pipeline_runs"))
        unopenable = raised(directory.current_revision)
    finally:
        empty.dispose()
        directory.dispose()
    assert type(missing_table).__name__ == "OperationalError" and not is_transient(missing_table)
    assert not is_transient(schema.value)
    assert isinstance(unopenable, StoreUnavailable) and not is_transient(unopenable)


# Chains and everything else


def test_platform_errors_are_transient_only_when_they_wrap_a_transient_failure(closed: str, moto_url: str) -> None:
    def wrap(cause: BaseException) -> StorageError:
        try:
            raise StorageError("reading the manifest failed") from cause
        except StorageError as exc:
            return exc

    away = raised(lambda: s3(closed).list_objects_v2(Bucket="sluicegate"))
    missing = raised(lambda: s3(moto_url).get_object(Bucket="transient-test", Key="nope"))
    assert is_transient(wrap(away))
    assert not is_transient(wrap(missing))

    def hide(cause: BaseException) -> DatasetError:
        try:
            raise cause
        except Exception:
            try:
                raise DatasetError("bad manifest") from None  # the cause is deliberately cut
            except DatasetError as exc:
                return exc

    assert not is_transient(hide(away))


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad value"),
        KeyError("missing"),
        TypeError("wrong type"),
        FileNotFoundError(2, "No such file or directory", "manifest.csv"),
        ConfigError("storage.port is wrong"),
        GateFailed("data gate failed"),
        RuntimeError("boom"),
    ],
)
def test_programming_and_input_errors_are_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_a_cyclic_chain_ends() -> None:
    first, second = ValueError("a"), KeyError("b")
    first.__context__, second.__context__ = second, first
    assert not is_transient(first)
