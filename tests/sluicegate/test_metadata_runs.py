"""Pipeline runs in the metadata store, on SQLite and on a real PostgreSQL: recording them, finding an
abandoned run on the same dataset version and taking it over, and a run's bookkeeping on a store
(``begin_run`` with a plain function standing in for Prefect's view of flow runs)."""

from __future__ import annotations

from typing import Any

import pytest

from sluicegate.metadata import DatasetVersion, MetadataStore, PipelineRun
from sluicegate.metadata.runs import (
    ACTIVE_STATES,
    RunStart,
    attach_dataset_version,
    attach_mlflow_run,
    begin_run,
    finish_pipeline_run,
    finish_run,
    pipeline_run_for_flow_run,
    pipeline_runs_for_dataset_version,
    set_pipeline_run_dataset,
    set_pipeline_run_mlflow,
    start_pipeline_run,
    take_over,
    unfinished_runs_like,
)
from tests.fixtures.metadata import COMMIT, OBJECTS, add_version, count, sha, start_run

OTHER_COMMIT = "b" * 40
PARAMS = {"bucket": "sluicegate", "key": "datasets/pcb/v1/manifest.csv", "version_id": "mv1", "event_id": "e1"}


def start(store: MetadataStore, flow_run_id: str, parameters: dict[str, Any], code: str = COMMIT) -> int:
    with store.session() as session:
        row = start_pipeline_run(
            session,
            prefect_flow_run_id=flow_run_id,
            trigger="event",
            trigger_event_id=None,
            code_version=code,
            code_dirty=False,
            parameters=parameters,
        )
        return row.id


def like(store: MetadataStore, parameters: dict[str, Any], own: str | None = "new") -> list[int]:
    with store.session() as session:
        found = unfinished_runs_like(session, code_version=COMMIT, parameters=parameters, exclude_flow_run_id=own)
        return [run.id for run in found]


def row_of(store: MetadataStore, run_id: int) -> PipelineRun:
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None
        return row


# --- recording runs -------------------------------------------------------------------------------------


def test_start_pipeline_run_is_idempotent_on_the_flow_run_id(store: MetadataStore) -> None:
    run = start_run(store, "fr-1")
    with store.session() as session:
        finish_pipeline_run(session, run.id, status="failed", reason="worker crashed")
    retried = start_run(store, "fr-1")
    assert retried.id == run.id
    assert (retried.status, retried.reason, retried.finished_at) == ("running", None, None)
    assert retried.parameters == {"bucket": "sluicegate", "key": "datasets/pcb/manifest.csv", "epochs": 2}
    assert count(store, PipelineRun) == 1


def test_runs_outside_prefect_are_each_new(store: MetadataStore) -> None:
    assert start_run(store, None).id != start_run(store, None).id
    assert count(store, PipelineRun) == 2


def test_pipeline_run_links_and_finish(store: MetadataStore) -> None:
    version = add_version(store, sha("one"))
    run = start_run(store)
    with store.session() as session:
        set_pipeline_run_dataset(session, run.id, version.id)
        set_pipeline_run_mlflow(session, run.id, "mlflow-run-1")
        finished = finish_pipeline_run(session, run.id, status="succeeded")
    assert finished.finished_at is not None and finished.finished_at >= finished.started_at
    with store.session() as session:
        runs = pipeline_runs_for_dataset_version(session, version.id)
        assert [(r.id, r.mlflow_run_id, r.status) for r in runs] == [(run.id, "mlflow-run-1", "succeeded")]
        assert pipeline_runs_for_dataset_version(session, version.id + 1000) == []
        with pytest.raises(LookupError, match="dataset version 999 does not exist"):
            set_pipeline_run_dataset(session, run.id, 999)
        with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
            set_pipeline_run_mlflow(session, 999, "x")


def test_pipeline_run_validation_messages(store: MetadataStore) -> None:
    with store.session() as session:
        with pytest.raises(ValueError, match=r"trigger must be one of 'event', 'schedule', 'manual', got 'cron'"):
            start_pipeline_run(
                session,
                prefect_flow_run_id="x",
                trigger="cron",
                trigger_event_id=None,
                code_version=COMMIT,
                code_dirty=False,
                parameters={},
            )
        with pytest.raises(ValueError, match="code_version must be a 40-hex git commit or 'unknown'"):
            start_pipeline_run(
                session,
                prefect_flow_run_id="x",
                trigger="manual",
                trigger_event_id=None,
                code_version="abc1234",
                code_dirty=True,
                parameters={},
            )
    run = start_run(store)
    message = r"status must be one of 'succeeded', 'failed', 'skipped', got 'running'"
    with store.session() as session, pytest.raises(ValueError, match=message):
        finish_pipeline_run(session, run.id, status="running")


def test_unknown_code_version_is_accepted(store: MetadataStore) -> None:
    with store.session() as session:
        run = start_pipeline_run(
            session,
            prefect_flow_run_id=None,
            trigger="manual",
            trigger_event_id=None,
            code_version="unknown",
            code_dirty=False,
            parameters={},
        )
    assert run.code_version == "unknown"


# --- taking over an abandoned run ---------------------------------------------------------------------


def test_only_unfinished_runs_of_the_same_manifest_version_and_code_match(store: MetadataStore) -> None:
    abandoned = start(store, "fr-1", PARAMS)
    finished = start(store, "fr-2", PARAMS)
    with store.session() as session:
        finish_pipeline_run(session, finished, status="failed", reason="data gate")
    start(store, "fr-3", {**PARAMS, "version_id": "mv2"})  # another version of the manifest
    start(store, "fr-4", PARAMS, code=OTHER_COMMIT)  # another build
    # The event id differs between deliveries of the same write: it is not part of the identity.
    assert like(store, {**PARAMS, "event_id": "e2"}) == [abandoned]
    assert like(store, PARAMS, own="fr-1") == []  # a run never takes itself over
    assert like(store, {**PARAMS, "key": "datasets/pcb/v2/manifest.csv"}) == []


def test_taking_over_moves_the_row_to_the_new_flow_run_and_keeps_the_history(store: MetadataStore) -> None:
    run_id = start(store, "fr-1", PARAMS)
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None
        take_over(session, row, prefect_flow_run_id="fr-2", previous_state="CRASHED")
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None
        take_over(session, row, prefect_flow_run_id="fr-3", previous_state="MISSING")
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None and row.prefect_flow_run_id == "fr-3" and row.status == "running"
        assert row.parameters["taken_over_from"] == [
            {"flow_run_id": "fr-1", "state": "CRASHED"},
            {"flow_run_id": "fr-2", "state": "MISSING"},
        ]
        assert row.parameters["key"] == PARAMS["key"]
        # Prefect retrying fr-3 itself still finds this one row.
        again = start_pipeline_run(
            session,
            prefect_flow_run_id="fr-3",
            trigger="event",
            trigger_event_id=None,
            code_version=COMMIT,
            code_dirty=False,
            parameters=PARAMS,
        )
        assert again.id == run_id


# --- a run's bookkeeping on a store ---------------------------------------------------------------------


class Prefect:
    """What the orchestrator says about flow runs: a plain table, "MISSING" for one it does not know."""

    def __init__(self, **states: str) -> None:
        self.states = states
        self.asked: list[str | None] = []

    def __call__(self, flow_run_id: str | None) -> str:
        self.asked.append(flow_run_id)
        return self.states.get(flow_run_id or "", "MISSING")


def begin(store: MetadataStore, flow_run_id: str | None, prefect: Prefect, **parameters: Any) -> RunStart:
    return begin_run(
        store,
        flow_run_id=flow_run_id,
        trigger="event",
        event_id="e1",
        code_commit=COMMIT,
        code_dirty=False,
        parameters={**PARAMS, **parameters},
        run_state=prefect,
    )


def test_begin_run_takes_over_an_abandoned_run_on_the_same_dataset_version(store: MetadataStore) -> None:
    first = begin(store, "fr-1", Prefect())
    assert first.taken_over is None and first.busy_with is None
    # fr-1's process died; Prefect saw it crash. fr-2 on the same manifest version continues its row.
    second = begin(store, "fr-2", Prefect(**{"fr-1": "CRASHED"}), event_id="e2")
    assert second == RunStart(first.run_id, taken_over="fr-1")
    row = row_of(store, first.run_id)
    assert (row.prefect_flow_run_id, row.status) == ("fr-2", "running")
    assert row.parameters["taken_over_from"] == [{"flow_run_id": "fr-1", "state": "CRASHED"}]
    # A flow run Prefect no longer knows is abandoned too.
    third = begin(store, "fr-3", Prefect())
    assert third == RunStart(first.run_id, taken_over="fr-2")
    assert count(store, PipelineRun) == 1


def test_begin_run_beside_a_live_run_starts_its_own_and_names_the_live_one(store: MetadataStore) -> None:
    live = begin(store, "fr-1", Prefect())
    for state in ACTIVE_STATES:
        prefect = Prefect(**{"fr-1": state})
        started = begin(store, f"fr-{state.lower()}", prefect)
        assert started.run_id != live.run_id and started.taken_over is None
        assert started.busy_with == "fr-1"
        assert "fr-1" in prefect.asked
        finish_run(store, started.run_id, "skipped", f"fr-1 is {state}")
    assert row_of(store, live.run_id).prefect_flow_run_id == "fr-1"
    # Another manifest version is not the same work: no live run to name.
    other = begin(store, "fr-other", Prefect(**{"fr-1": "RUNNING"}), version_id="mv2")
    assert other.busy_with is None and other.taken_over is None


def test_begin_run_again_for_its_own_flow_run_gets_its_own_row(store: MetadataStore) -> None:
    first = begin(store, "fr-1", Prefect())
    finish_run(store, first.run_id, "failed", "worker lost")
    begin(store, "fr-0", Prefect(**{"fr-1": "RUNNING"}))  # another unfinished run like it
    prefect = Prefect()  # would call every other run abandoned
    again = begin(store, "fr-1", prefect)  # Prefect retries fr-1 itself
    assert again == RunStart(first.run_id)
    assert prefect.asked == []  # a retry looks for nothing to take over
    row = row_of(store, first.run_id)
    assert (row.status, row.reason, row.finished_at, row.prefect_flow_run_id) == ("running", None, None, "fr-1")
    assert count(store, PipelineRun) == 2


def test_begin_run_validates_like_start_pipeline_run(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="code_version must be a 40-hex git commit or 'unknown'"):
        begin_run(
            store,
            flow_run_id="fr-1",
            trigger="event",
            event_id=None,
            code_commit="abc1234",
            code_dirty=False,
            parameters=PARAMS,
            run_state=Prefect(),
        )
    assert count(store, PipelineRun) == 0


def test_attach_dataset_version_mlflow_run_and_finish(store: MetadataStore) -> None:
    run_id = begin(store, "fr-1", Prefect()).run_id
    fields: dict[str, Any] = {
        "dataset_name": "pcb",
        "data_version": sha("manifest"),
        "bucket": "sluicegate",
        "prefix": "datasets/pcb/v1/",
        "manifest_key": "datasets/pcb/v1/manifest.csv",
        "manifest_etag": '"m1"',
        "manifest_version_id": "mv1",
        "objects": OBJECTS,
    }
    version_id = attach_dataset_version(store, run_id, **fields)
    assert attach_dataset_version(store, run_id, **fields) == version_id  # a retried stage: the same row
    attach_mlflow_run(store, run_id, "mlflow-run-1")
    finish_run(store, run_id, "succeeded", None)
    row = row_of(store, run_id)
    assert (row.dataset_version_id, row.mlflow_run_id, row.status, row.reason) == (
        version_id,
        "mlflow-run-1",
        "succeeded",
        None,
    )
    assert row.finished_at is not None
    assert count(store, DatasetVersion) == 1
    with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
        attach_mlflow_run(store, 999, "x")
    with pytest.raises(ValueError, match="status must be one of 'succeeded', 'failed', 'skipped', got 'done'"):
        finish_run(store, run_id, "done", None)


def test_pipeline_run_for_flow_run(store: MetadataStore) -> None:
    run = start_run(store, "fr-1")
    with store.session() as session:
        found = pipeline_run_for_flow_run(session, "fr-1")
        assert found is not None and found.id == run.id
        assert pipeline_run_for_flow_run(session, "fr-2") is None
