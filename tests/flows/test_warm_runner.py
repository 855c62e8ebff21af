"""The warm runner on a real Prefect server: runs start forked from its preloaded server, each in a
process of its own; a run that dies is marked Crashed and takes neither the runner nor other runs with
it; cancellation still kills the run's process.

The runner here polls once, at its start: every run in these tests is started because the server
announced it (the flow-run event), so they fail if that path breaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling

from tests.fixtures.services import LOOPBACK, QUIET_ENV, free_port, wait_http

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
POLL_SECONDS = 3600  # after the first poll, none within a test's lifetime


@dataclass
class WarmRunner:
    proc: subprocess.Popen[bytes]
    suffix: str
    health: str
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.health, timeout=5).status_code == 200


@pytest.fixture(scope="module")
def client(prefect_api: str) -> Iterator[SyncPrefectClient]:
    with temporary_settings({PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as prefect:
        yield prefect


@pytest.fixture(scope="module")
def runner(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmRunner]:
    """``python -m tests.flows.serve_warm_flows``, as the stack runs ``python -m flows.deployments``."""
    suffix = uuid.uuid4().hex[:8]  # the server outlives this module: deployments of our own
    port = free_port()
    log = tmp_path_factory.mktemp("warm-runner") / "runner.log"
    env = {
        **os.environ,
        **QUIET_ENV,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_RUNNER_SERVER_ENABLE": "true",
        "PREFECT_RUNNER_SERVER_HOST": LOOPBACK,
        "PREFECT_RUNNER_SERVER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.flows.serve_warm_flows", suffix, str(POLL_SECONDS)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    health = f"http://{LOOPBACK}:{port}/health"
    wait_http(health, proc, log)
    yield WarmRunner(proc, suffix, health, log)
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()


def start(client: SyncPrefectClient, runner: WarmRunner, flow_name: str, **parameters: Any) -> uuid.UUID:
    deployment = client.read_deployment_by_name(f"{flow_name}/{flow_name}-{runner.suffix}")
    return client.create_flow_run_from_deployment(deployment.id, parameters=parameters).id


def finished(client: SyncPrefectClient, runner: WarmRunner, run_id: uuid.UUID, timeout: float = 120) -> FlowRun:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        time.sleep(0.1)
    pytest.fail(f"flow run {run_id} not finished within {timeout:.0f} s; runner log:\n{runner.log.read_text()[-3000:]}")


def appears(path: Path, runner: WarmRunner, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    pytest.fail(f"{path} not written within {timeout:.0f} s; runner log:\n{runner.log.read_text()[-3000:]}")


def test_a_crashing_flow_run_does_not_take_the_warm_runner_down(
    client: SyncPrefectClient, runner: WarmRunner, tmp_path: Path
) -> None:
    go, started = tmp_path / "go", tmp_path / "started"
    waiting = start(client, runner, "warm-wait", path=str(go), started=str(started))
    appears(started, runner)  # in flight while the others die

    crashed = [start(client, runner, "warm-crash", how=how) for how in ("exit", "kill")]
    for run_id, code in zip(crashed, ("13", "-9"), strict=True):
        run = finished(client, runner, run_id)
        assert run.state is not None and run.state.is_crashed(), run.state
        assert f"status code: {code}" in (run.state.message or ""), run.state.message

    assert runner.alive()
    go.write_text("go")
    survivor = finished(client, runner, waiting)
    assert survivor.state is not None and survivor.state.is_completed(), survivor.state
    after = finished(client, runner, start(client, runner, "warm-probe", out=str(tmp_path / "after.json")))
    assert after.state is not None and after.state.is_completed(), after.state
    assert runner.alive()


def test_runs_are_forked_from_the_preloaded_server_one_process_each(
    client: SyncPrefectClient, runner: WarmRunner, tmp_path: Path
) -> None:
    reports = []
    for index in range(2):
        out = tmp_path / f"probe-{index}.json"
        run = finished(client, runner, start(client, runner, "warm-probe", out=str(out)))
        assert run.state is not None and run.state.is_completed(), run.state
        reports.append((run, json.loads(out.read_text())))

    (first_run, first), (_, second) = reports
    # Module state does not leak: each run's module saw one call, its own.
    assert first["calls"] == second["calls"] == 1
    assert first["pid"] != second["pid"]
    # Forked from the server the runner started (not spawned by the runner itself, Prefect's default).
    assert first["ppid"] == second["ppid"] != runner.proc.pid
    assert psutil.Process(first["ppid"]).ppid() == runner.proc.pid
    # The run's logs reach the API (shipped in batches, the last one as its process exits).
    assert logged(client, first_run.id, f"probe running in process {first['pid']}")


def logged(client: SyncPrefectClient, run_id: uuid.UUID, text: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        if any(text in record.message for record in logs):
            return True
        time.sleep(0.2)
    return False


def test_cancelling_a_run_kills_its_process(client: SyncPrefectClient, runner: WarmRunner, tmp_path: Path) -> None:
    started = tmp_path / "started"
    run_id = start(client, runner, "warm-wait", path=str(tmp_path / "never"), started=str(started))
    pid = int(appears(started, runner))

    client.set_flow_run_state(run_id, Cancelling(), force=True)
    run = finished(client, runner, run_id)
    assert run.state is not None and run.state.is_cancelled(), run.state
    # Gone, or exited and not yet reaped by the forkserver (its parent).
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert runner.alive()
