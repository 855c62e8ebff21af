"""Finding and taking over an abandoned pipeline run, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sluicegate.metadata import MetadataStore, PipelineRun, takeover
from sluicegate.metadata import repository as repo

COMMIT, OTHER_COMMIT = "a" * 40, "b" * 40
PARAMS = {"bucket": "sluicegate", "key": "datasets/pcb/v1/manifest.csv", "version_id": "mv1", "event_id": "e1"}


@pytest.fixture
def store(store_url: str) -> Iterator[MetadataStore]:
    store = MetadataStore(store_url)
    store.upgrade()
    yield store
    store.dispose()


def start(store: MetadataStore, flow_run_id: str, parameters: dict[str, Any], code: str = COMMIT) -> int:
    with store.session() as session:
        row = repo.start_pipeline_run(
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
        found = takeover.unfinished_runs_like(
            session, code_version=COMMIT, parameters=parameters, exclude_flow_run_id=own
        )
        return [run.id for run in found]


def test_only_unfinished_runs_of_the_same_manifest_version_and_code_match(store: MetadataStore) -> None:
    abandoned = start(store, "fr-1", PARAMS)
    finished = start(store, "fr-2", PARAMS)
    with store.session() as session:
        repo.finish_pipeline_run(session, finished, status="failed", reason="data gate")
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
        takeover.take_over(session, row, prefect_flow_run_id="fr-2", previous_state="CRASHED")
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None
        takeover.take_over(session, row, prefect_flow_run_id="fr-3", previous_state="MISSING")
    with store.session() as session:
        row = session.get(PipelineRun, run_id)
        assert row is not None and row.prefect_flow_run_id == "fr-3" and row.status == "running"
        assert row.parameters["taken_over_from"] == [
            {"flow_run_id": "fr-1", "state": "CRASHED"},
            {"flow_run_id": "fr-2", "state": "MISSING"},
        ]
        assert row.parameters["key"] == PARAMS["key"]
        # Prefect retrying fr-3 itself still finds this one row.
        again = repo.start_pipeline_run(
            session,
            prefect_flow_run_id="fr-3",
            trigger="event",
            trigger_event_id=None,
            code_version=COMMIT,
            code_dirty=False,
            parameters=PARAMS,
        )
        assert again.id == run_id
