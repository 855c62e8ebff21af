"""The embedded stack as a user runs it, and the whole event chain over HTTP:
PUT manifest -> S3 notification -> SQS -> bridge -> Prefect event -> trigger -> flow run -> rows + MLflow run.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import select

from sluicegate import storage
from sluicegate.app import stack
from sluicegate.errors import StackError
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.gates import gate_results_for_run
from sluicegate.metadata.models import DeadLetter, PipelineRun, S3Event
from sluicegate.settings import Settings
from tasks import tracking
from tests.fixtures.platform import upload_dataset
from tests.fixtures.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def stack_settings(home: Path, **overrides: Any) -> Settings:
    """Free ports and short training; ``overrides`` replace whole groups (e.g. ``training={...}``)."""
    groups: dict[str, Any] = {
        "storage": {"port": free_port()},
        "prefect": {"port": free_port(), "runner_port": free_port(), "ui": False},
        "mlflow": {"port": free_port()},
        "events": {"webhook_port": free_port()},
        "stack": {"start_timeout": 180, "stop_timeout": 15},
        "rollout": {"local_grpc": f"127.0.0.1:{free_port()}", "local_http": f"http://127.0.0.1:{free_port()}"},
        "training": {"epochs": 2, "width": 8},
        # Wiring, not model quality: two-epoch runs on random images have no stable final loss.
        "train_gate": {"final_loss_tolerance": 100.0, "memory_tolerance": 100.0},
        "eval_gate": {
            "first_model_min_accuracy": 0.0,
            "baseline_margin": -1.0,  # random images: no baselines to beat
            "latency_iterations": 30,
            "warmup_iterations": 5,
        },
    }
    return Settings(home=home, **{**groups, **overrides})


def all_pids(settings: Settings) -> set[int]:
    state = stack.read_state(stack.Paths(settings.home))
    assert state is not None
    pids = {state.supervisor_pid} | {part.pid for part in state.parts.values() if part.pid}
    for pid in list(pids):
        with contextlib.suppress(psutil.NoSuchProcess):
            pids |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
    return pids


def stack_running(settings: Settings) -> Iterator[Settings]:
    """The body of a stack fixture: up (down again if it fails to come up), yield, down."""
    try:
        state, started = stack.up(settings)
    except StackError:
        stack.down(settings)
        raise
    assert started and state.status == stack.READY
    yield settings
    stack.down(settings)


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    yield from stack_running(stack_settings(tmp_path_factory.mktemp("stack")))


def flow_runs_for(settings: Settings, key: str) -> list[dict[str, Any]]:
    response = httpx.post(
        f"{settings.prefect.url}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": ["pipeline"]}}, "limit": 200}
    )
    response.raise_for_status()
    return [run for run in response.json() if run["parameters"].get("key") == key]


def wait_for_run(settings: Settings, key: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    runs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        runs = flow_runs_for(settings, key)
        if runs and runs[0]["state_type"] in ("COMPLETED", "FAILED", "CRASHED"):
            return runs[0]
        time.sleep(0.5)
    logs = (settings.home / "logs" / "runner.log").read_text()[-3000:]
    pytest.fail(f"no finished flow run for {key} within {timeout} s (runs: {runs}); runner log:\n{logs}")


def test_up_again_is_a_no_op_and_status_is_healthy(running_stack: Settings) -> None:
    before = all_pids(running_stack)
    state, started = stack.up(running_stack)
    assert not started and state.status == stack.READY
    assert all_pids(running_stack) == before
    overall, rows = stack.status(running_stack)
    assert overall == stack.READY
    assert {row.name for row in rows} == {"s3", "prefect", "mlflow", "serving", "bridge", "runner"}
    assert all(row.healthy and row.running for row in rows)


def test_manifest_upload_runs_the_pipeline_and_records_lineage(running_stack: Settings) -> None:
    key = upload_dataset(running_stack, "pcb", "chain", count=6)
    run = wait_for_run(running_stack, key)
    assert run["state_type"] == "COMPLETED", run["state"]
    assert run["name"].startswith("pipeline/pcb@")
    # Tags operators filter on: the deployment's, plus the dataset, data and code versions.
    data7 = run["name"].split("@")[1]
    assert {"pipeline", "dataset:pcb", f"data:{data7}"} <= set(run["tags"])
    assert any(tag.startswith("code:") for tag in run["tags"])
    store = MetadataStore(running_stack.metadata_url)
    with store.session() as session:
        row = session.scalars(select(PipelineRun).where(PipelineRun.prefect_flow_run_id == run["id"])).one()
        event = session.scalars(select(S3Event).where(S3Event.key == key)).one()
        assert row.status == "succeeded" and row.trigger == "event"
        assert row.trigger_event_id == event.event_id == run["parameters"]["event_id"]
        assert row.dataset_version_id is not None and row.mlflow_run_id
        mlflow_run_id = row.mlflow_run_id
    store.dispose()
    tracked = tracking.client(running_stack.mlflow.url).get_run(mlflow_run_id)
    assert tracked.data.tags[tracking.TAG_FLOW_RUN] == run["id"]
    assert tracked.data.tags[tracking.TAG_EVENT] == event.event_id
    # The summary artifact is in Prefect for operators.
    artifacts = httpx.post(
        f"{running_stack.prefect.url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
    ).json()
    assert any(a["type"] == "markdown" and "data version" in a["data"] for a in artifacts)


def test_duplicate_delivery_gives_one_run(running_stack: Settings) -> None:
    key = upload_dataset(running_stack, "pcb", "dup", count=6)
    first = wait_for_run(running_stack, key)
    head = storage.s3_client(running_stack).head_object(Bucket=running_stack.storage.bucket, Key=key)
    # The notification as moto sends it (no versionId, no sequencer), delivered twice more:
    # once again through SQS, once through the webhook.
    body = json.dumps(
        {
            "Records": [
                {
                    "eventVersion": "2.1",
                    "eventSource": "aws:s3",
                    "eventName": "ObjectCreated:Put",
                    "eventTime": "2026-11-29T10:00:00.000Z",
                    "s3": {
                        "bucket": {"name": running_stack.storage.bucket},
                        "object": {"key": key, "size": head["ContentLength"], "eTag": head["ETag"].strip('"')},
                    },
                }
            ]
        }
    )
    sqs = storage.sqs_client(running_stack)
    sqs.send_message(QueueUrl=storage.queue_url(running_stack, sqs), MessageBody=body)
    hook = httpx.post(f"http://127.0.0.1:{running_stack.events.webhook_port}/events", content=body)
    assert hook.status_code == 200 and hook.json()["duplicates"] == 1
    time.sleep(6)  # several runner polls: a second run would have been created by now
    runs = flow_runs_for(running_stack, key)
    assert [r["id"] for r in runs] == [first["id"]]


def test_a_malformed_message_does_not_stop_the_next_good_one(running_stack: Settings) -> None:
    sqs = storage.sqs_client(running_stack)
    sqs.send_message(QueueUrl=storage.queue_url(running_stack, sqs), MessageBody='{"Records": "oops"}')
    key = upload_dataset(running_stack, "pcb", "after-bad", count=6)
    assert wait_for_run(running_stack, key)["state_type"] == "COMPLETED"
    store = MetadataStore(running_stack.metadata_url)
    with store.session() as session:
        letters = session.scalars(select(DeadLetter)).all()
        assert any('"oops"' in letter.body and "Records" in letter.error for letter in letters)
    store.dispose()


def test_a_triggered_run_on_a_corrupt_dataset_stops_at_the_data_gate(running_stack: Settings, tmp_path: Path) -> None:
    from tasks.sample_data import Corruption, make_sample
    from tasks.transfer import push_directory

    make_sample(tmp_path / "data", count=60, seed=9, corrupt=Corruption.SKEWED_LABELS)
    pushed = push_directory(running_stack, tmp_path / "data", "pcb", "skewed")
    run = wait_for_run(running_stack, pushed.manifest_key)
    assert run["state_type"] == "FAILED"
    assert "label distribution" in run["state"]["message"]
    store = MetadataStore(running_stack.metadata_url)
    with store.session() as session:
        row = session.scalars(select(PipelineRun).where(PipelineRun.prefect_flow_run_id == run["id"])).one()
        gates = {g.gate: (g.passed, g.report_uri) for g in gate_results_for_run(session, row.id)}
        assert row.status == "failed" and "label distribution" in (row.reason or "")
    store.dispose()
    assert list(gates) == ["data"] and gates["data"][0] is False and gates["data"][1]
    artifacts = httpx.post(
        f"{running_stack.prefect.url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
    ).json()
    report = next(a for a in artifacts if a["key"] == "data-gate-pcb")
    assert "label distribution" in report["data"] and "FAIL" in report["data"]


def test_a_crashed_part_is_restarted(running_stack: Settings) -> None:
    state = stack.read_state(stack.Paths(running_stack.home))
    assert state is not None
    old = state.parts["bridge"].pid
    assert old is not None
    psutil.Process(old).kill()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = stack.read_state(stack.Paths(running_stack.home))
        assert state is not None
        if state.parts["bridge"].pid != old and state.parts["bridge"].status == stack.READY:
            break
        time.sleep(0.5)
    assert state.parts["bridge"].restarts == 1
    overall, _ = stack.status(running_stack)
    assert overall == stack.READY


def test_down_leaves_no_process_behind(tmp_path: Path) -> None:
    settings = stack_settings(tmp_path)
    stack.up(settings)
    pids = all_pids(settings)
    assert len(pids) >= 6  # supervisor and five parts, plus their own children
    stack.down(settings)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    overall, _ = stack.status(settings)
    assert overall == "stopped"


def test_a_part_that_cannot_start_is_named_with_its_log(tmp_path: Path) -> None:
    settings = stack_settings(tmp_path)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", settings.mlflow.port))
    blocker.listen()
    try:
        with pytest.raises(StackError, match=r"mlflow failed to start(.|\n)*last lines of .*mlflow.log"):
            stack.up(settings)
    finally:
        blocker.close()
        stack.down(settings)
    assert not stack.supervisor_alive(stack.Paths(settings.home))


def _flow_run_process(settings: Settings, flow_run_id: str) -> psutil.Process | None:
    """The runner's process executing ``flow_run_id``: the runner records it on the flow run (host:pid)."""
    state = stack.read_state(stack.Paths(settings.home))
    assert state is not None and state.parts["runner"].pid
    recorded = httpx.get(f"{settings.prefect.url}/flow_runs/{flow_run_id}").json().get("infrastructure_pid")
    if not recorded:
        return None
    pid = int(recorded.rsplit(":", 1)[1])
    # One of the runner's own descendants (warm runs are children of its forkserver), not a stale pid.
    for child in psutil.Process(state.parts["runner"].pid).children(recursive=True):
        if child.pid == pid:
            return child
    return None


def _wait(what: str, predicate: Any, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_pipeline_killed_mid_run_is_rerun_without_duplicates(running_stack: Settings) -> None:
    from sluicegate.metadata.models import ModelVersion
    from tasks import registry

    key = upload_dataset(running_stack, "pcb", "killed", count=6, seed=5)
    store = MetadataStore(running_stack.metadata_url)

    def packaged() -> dict[str, Any] | None:
        # Killed once its model version is written and registered: the eval gate is still to come.
        runs = flow_runs_for(running_stack, key)
        if not runs:
            return None
        with store.session() as session:
            row = session.scalars(select(PipelineRun).where(PipelineRun.prefect_flow_run_id == runs[0]["id"])).first()
            if row is None or session.scalars(select(ModelVersion).filter_by(pipeline_run_id=row.id)).first() is None:
                return None
        return runs[0]

    first = _wait("the model version of the first run", packaged)
    process = _wait("the flow run's process", lambda: _flow_run_process(running_stack, first["id"]))
    process.kill()  # as the OOM killer would: no handler runs, nothing is recorded as finished
    crashed = wait_for_run(running_stack, key)
    assert crashed["id"] == first["id"] and crashed["state_type"] == "CRASHED"

    # The operator runs the deployment again with the same parameters (`prefect deployment run`, the UI).
    api = running_stack.prefect.url
    deployment = httpx.get(f"{api}/deployments/name/pipeline/dataset-pipeline").json()
    rerun = httpx.post(
        f"{api}/deployments/{deployment['id']}/create_flow_run", json={"parameters": first["parameters"]}
    ).json()
    finished = _wait(
        "the re-run to finish",
        lambda: next((r for r in flow_runs_for(running_stack, key) if r["id"] == rerun["id"] and r["end_time"]), None),
    )
    runner_log = (running_stack.home / "logs" / "runner.log").read_text()[-4000:]
    assert finished["state_type"] == "COMPLETED", f"{finished['state']}\nrunner log:\n{runner_log}"

    with store.session() as session:
        runs = session.scalars(
            select(PipelineRun).where(PipelineRun.prefect_flow_run_id.in_([first["id"], rerun["id"]]))
        )
        (row,) = runs.all()  # one row: the re-run took the abandoned one over
        assert row.prefect_flow_run_id == rerun["id"] and row.status == "succeeded"
        assert row.parameters["taken_over_from"] == [{"flow_run_id": first["id"], "state": "CRASHED"}]
        models = session.scalars(select(ModelVersion).filter_by(pipeline_run_id=row.id)).all()
        assert len(models) == 1
        model_version, mlflow_run_id = models[0].version, row.mlflow_run_id
        gates = [g.gate for g in gate_results_for_run(session, row.id)]
        assert len(gates) == len(set(gates)) and "eval" in gates
    store.dispose()
    # Dataset "pcb" trains model "pcb" (no spec: the model is named after its dataset).
    tagged = [v for v in registry.list_versions(running_stack.mlflow.url, "pcb")]
    assert [v.model_version for v in tagged].count(model_version) == 1  # one registry version, not two
    tracker = tracking.client(running_stack.mlflow.url)
    experiment = tracking.experiment_id(tracker, running_stack.mlflow.experiment)
    same_run = tracker.search_runs([experiment], f"tags.`{tracking.TAG_PIPELINE_RUN}` = '{row.id}'")
    assert [r.info.run_id for r in same_run] == [mlflow_run_id]


def test_two_datasets_landing_together_run_side_by_side(running_stack: Settings) -> None:
    from sluicegate.metadata.models import ModelVersion

    # Different sizes, so different manifests and data versions (the data version is the manifest's sha256).
    keys = [
        upload_dataset(running_stack, name, "together", count=count, seed=seed)
        for name, count, seed in (("pcb", 6, 7), ("pcb-b", 9, 8))
    ]
    runs = [wait_for_run(running_stack, key, timeout=300) for key in keys]
    assert [run["state_type"] for run in runs] == ["COMPLETED", "COMPLETED"], [run["state"] for run in runs]
    assert runs[0]["name"].startswith("pipeline/pcb@") and runs[1]["name"].startswith("pipeline/pcb-b@")
    starts = sorted((run["start_time"], run["end_time"]) for run in runs)
    assert starts[1][0] < starts[0][1]  # they overlapped: neither waited for the other
    store = MetadataStore(running_stack.metadata_url)
    with store.session() as session:
        rows = [
            session.scalars(select(PipelineRun).where(PipelineRun.prefect_flow_run_id == run["id"])).one()
            for run in runs
        ]
        assert [row.dataset_version.dataset.name for row in rows if row.dataset_version] == ["pcb", "pcb-b"]
        models = [session.scalars(select(ModelVersion).filter_by(pipeline_run_id=row.id)).one() for row in rows]
        assert models[0].version != models[1].version
        assert models[0].data_version != models[1].data_version
        assert len({row.mlflow_run_id for row in rows}) == 2
    store.dispose()
