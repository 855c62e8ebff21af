"""Outages of the network dependencies: a short one is retried through, a lasting one is reported clearly.

Flows run in-process against the session's real Prefect server; the dependency that goes away is a
real server of its own (moto in a thread, an MLflow process), stopped and started again on the same
port with the same state. Stage clients make a single attempt (botocore) or few (MLflow) so that the
outage is met by the stage's retry policy, the part under test, and not absorbed by the client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from moto.server import ThreadedMotoServer
from prefect import flow

from flows.wrappers import stage
from sluicegate.errors import StoreUnavailable
from sluicegate.metadata import MetadataStore
from sluicegate.transient import is_transient
from tests.fixtures.services import LOOPBACK, Service, free_port, single_try_s3, start_mlflow

BUCKET = "outage-test"
OUTAGE_S = 4.0
# Set by a stage right before it calls the dependency: the outage is timed from the stage's first
# attempt, not from the flow's start (which takes seconds on a busy machine).
ATTEMPTED = threading.Event()


@pytest.fixture(autouse=True)
def prefect(prefect_api: str) -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        yield prefect_api


def s3(endpoint: str) -> Any:
    return single_try_s3(endpoint, read_timeout=10)


def _read_object(endpoint: str, key: str) -> str:
    client = s3(endpoint)
    ATTEMPTED.set()
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()


def _log_metric(tracking_uri: str, run_id: str) -> None:
    from tasks import tracking

    tracker = tracking.client(tracking_uri)
    ATTEMPTED.set()
    tracker.log_metric(run_id, "survived_outage", 1.0)


def _epochs(value: str) -> int:
    return int(value)


read_object = stage(_read_object, "outage-read-object")
log_metric = stage(_log_metric, "outage-log-metric")
parse_epochs = stage(_epochs, "outage-parse-epochs")


@flow(name="outage-read")
def read_flow(endpoint: str, key: str) -> dict[str, str]:
    state = read_object(endpoint, key, return_state=True)
    return _outcome(state)


@flow(name="outage-log")
def log_flow(tracking_uri: str, run_id: str) -> dict[str, str]:
    return _outcome(log_metric(tracking_uri, run_id, return_state=True))


@flow(name="outage-bad-input")
def bad_input_flow() -> dict[str, str]:
    return _outcome(parse_epochs("two", return_state=True))


def _outcome(state: Any) -> dict[str, str]:
    # A flow that returned the Failed state would fail itself; the test wants to look at the task run.
    value = state.result(raise_on_failure=False)
    return {"task_run_id": str(state.state_details.task_run_id), "state": state.type.value, "value": repr(value)}


def task_history(task_run_id: str) -> tuple[list[str], int]:
    """The names of the task run's states, oldest first, and how many times it ran."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        states = client.read_task_run_states(UUID(task_run_id))
        run = client.read_task_run(UUID(task_run_id))
    ordered = sorted(states, key=lambda state: state.timestamp)
    return [str(state.name) for state in ordered], run.run_count


def _after_first_attempt(delay: float, start: Callable[[], None]) -> None:
    if not ATTEMPTED.wait(timeout=120):
        pytest.fail("the stage never called its dependency")
    time.sleep(delay)
    start()


@pytest.fixture(autouse=True)
def _no_attempt_yet() -> None:
    ATTEMPTED.clear()


class MotoOnAPort:
    """moto in a thread of this process on a fixed port, which can be stopped and started again.

    moto keeps its backends per process, so a server started again serves the same buckets and objects.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture
def moto_server() -> Iterator[MotoOnAPort]:
    server = MotoOnAPort()
    server.start()
    client = s3(server.endpoint)
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="datasets/pcb/a/manifest.csv", Body=b"path,label,split\n")
    yield server
    server.stop()


def test_s3_away_for_a_few_seconds_is_retried_through(moto_server: MotoOnAPort) -> None:
    moto_server.stop()
    with ThreadPoolExecutor(1) as pool:
        restart = pool.submit(_after_first_attempt, OUTAGE_S, moto_server.start)
        outcome = read_flow(moto_server.endpoint, "datasets/pcb/a/manifest.csv")
        restart.result()
    assert outcome["state"] == "COMPLETED" and "path,label,split" in outcome["value"]
    names, runs = task_history(outcome["task_run_id"])
    assert "AwaitingRetry" in names and runs >= 2, names
    assert names[-1] == "Completed"


def test_a_missing_key_is_not_retried(moto_server: MotoOnAPort) -> None:
    outcome = read_flow(moto_server.endpoint, "datasets/pcb/none/manifest.csv")
    assert outcome["state"] == "FAILED" and "NoSuchKey" in outcome["value"]
    names, runs = task_history(outcome["task_run_id"])
    assert "AwaitingRetry" not in names and runs == 1, names


def test_bad_input_is_not_retried() -> None:
    outcome = bad_input_flow()
    assert outcome["state"] == "FAILED" and "ValueError" in outcome["value"]
    names, runs = task_history(outcome["task_run_id"])
    assert "AwaitingRetry" not in names and runs == 1, names


class MlflowOnAPort:
    """A real MLflow server process of the test's own, which can be stopped and started again on the
    same port over the same SQLite store and artifact folder."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.uri = f"http://{LOOPBACK}:{self.port}"
        self._service: Service | None = None
        self._starts = 0

    def start(self) -> None:
        self._starts += 1
        self._service = start_mlflow(self.workdir, self.port, name=f"mlflow-{self._starts}")

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowOnAPort]:
    server = MlflowOnAPort(tmp_path)
    server.start()
    yield server
    server.stop()


def test_mlflow_restarted_on_the_same_port_is_retried_through(
    mlflow_server: MlflowOnAPort, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks import tracking

    # MLflow's own HTTP retries off: with 2 (~5 s of back-off) a fast cold start came back within them
    # and the run completed without the stage-level retry this test is about (CI: Pending, Running,
    # Completed). Now the first refused call fails the attempt and the stage's retry carries it through.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = tracking.client(mlflow_server.uri)
    run_id = tracker.create_run(tracker.create_experiment("outage")).info.run_id
    mlflow_server.stop()
    with ThreadPoolExecutor(1) as pool:
        restart = pool.submit(_after_first_attempt, 0.0, mlflow_server.start)  # away for a cold start
        outcome = log_flow(mlflow_server.uri, run_id)
        restart.result()
    assert outcome["state"] == "COMPLETED", outcome
    names, runs = task_history(outcome["task_run_id"])
    assert "AwaitingRetry" in names and runs >= 2, names
    assert tracker.get_run(run_id).data.metrics["survived_outage"] == 1.0


def test_postgres_away_fails_the_pipeline_with_the_url_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.pipeline import pipeline

    url = f"postgresql+psycopg://sluicegate:secret@{LOOPBACK}:{free_port()}/metadata"
    redacted = f"postgresql+psycopg://sluicegate:***@{LOOPBACK}:"
    store = MetadataStore(url)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            store.check_schema()
    finally:
        store.dispose()
    message = str(caught.value)
    assert redacted in message and "secret" not in message
    assert "is PostgreSQL running" in message and "SLUICEGATE_METADATA__URL" in message
    assert is_transient(caught.value)  # a stage meeting it mid-run retries it

    monkeypatch.setenv("SLUICEGATE_HOME", str(tmp_path))
    monkeypatch.setenv("SLUICEGATE_METADATA__URL", url)
    state = pipeline(bucket=BUCKET, key="datasets/pcb/a/manifest.csv", trigger="manual", return_state=True)
    assert state.is_failed()
    assert state.message is not None and "StoreUnavailable" in state.message
    assert redacted in state.message and "secret" not in state.message
    with pytest.raises(StoreUnavailable, match="is PostgreSQL running"):
        state.result()
