"""Model versions and alias moves in the metadata store, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from sluicegate.metadata import AliasChange, MetadataStore, ModelVersion
from sluicegate.metadata.model_versions import (
    alias_changes_for_model_version,
    alias_changes_for_version,
    alias_history,
    find_model_version,
    find_model_versions,
    model_version_for_run,
    model_versions_for_dataset_version,
    record_alias_change,
)
from tests.fixtures.metadata import add_version, count, model_version, sha, start_run


def test_record_model_version_is_idempotent_and_last_record_wins(store: MetadataStore) -> None:
    run = start_run(store)
    first = model_version(store, pipeline_run_id=run.id)
    second = model_version(store, pipeline_run_id=run.id, mlflow_model_version="3", artifacts={"model.onnx": "d" * 64})
    assert second.id == first.id
    assert count(store, ModelVersion) == 1
    with store.session() as session:
        loaded = session.get(ModelVersion, first.id)
        assert loaded is not None
        assert (loaded.mlflow_model_version, loaded.artifacts) == ("3", {"model.onnx": "d" * 64})
        assert loaded.environment == {"python": "3.11.7", "torch": "2.13.0", "gpu": None}
        assert loaded.pipeline_run is not None and loaded.pipeline_run.id == run.id


def test_record_model_version_validation(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="data_version must be 64 lowercase hex"):
        model_version(store, data_version="bbbbbbb")
    with pytest.raises(LookupError, match="pipeline run 42 does not exist"):
        model_version(store, pipeline_run_id=42)
    assert count(store, ModelVersion) == 0


def test_find_model_version_exactly_or_by_prefix(store: MetadataStore) -> None:
    first = model_version(store, version="v1.0.0-aaaaaaa-bbbbbbb")
    second = model_version(store, version="v1.0.1-aaaaaaa-bbbbbbb")
    other = model_version(store, model_name="wafers", version="v1.0.0-ccccccc-bbbbbbb")
    with store.session() as session:
        found = find_model_version(session, "pcb-defects", second.version)
        assert found is not None and found.id == second.id
        assert find_model_version(session, "wafers", second.version) is None

        def ids(ref: str, model_name: str | None = None) -> list[int]:
            return [row.id for row in find_model_versions(session, ref, model_name)]

        assert ids(first.version) == [first.id]  # an exact match wins over the prefixes it is one of
        assert ids("v1.0") == [first.id, second.id, other.id]
        assert ids("v1.0", "wafers") == [other.id]  # the configured model's, when several models match
        assert ids("v1.0", "pcb-defects") == [first.id, second.id]
        assert ids("v1.0_") == []  # LIKE wildcards in the reference are literal


def test_model_versions_of_a_run_and_of_a_dataset_version(store: MetadataStore) -> None:
    version = add_version(store, sha("one"))
    run = start_run(store)
    linked = model_version(
        store, version="v1", pipeline_run_id=run.id, dataset_version_id=version.id, data_version=version.data_version
    )
    by_hash = model_version(store, version="v2", data_version=version.data_version)
    model_version(store, version="v3", data_version="c" * 64)
    with store.session() as session:
        found = model_version_for_run(session, run.id)
        assert found is not None and found.id == linked.id
        assert model_version_for_run(session, run.id + 1) is None
        assert [m.id for m in model_versions_for_dataset_version(session, version)] == [linked.id, by_hash.id]


def move(store: MetadataStore, alias: str, to: str | None, to_version: str | None, **kwargs: Any) -> AliasChange:
    fields: dict[str, Any] = {"previous_registry_version": None, "previous_model_version": None, "actor": "alice"}
    fields.update(kwargs)
    with store.session() as session:
        return record_alias_change(
            session,
            model_name="pcb-defects",
            alias=alias,
            registry_version=to,
            model_version=to_version,
            reason=f"{alias} to {to}",
            **fields,
        )


def test_alias_moves_are_recorded_and_read_back(store: MetadataStore) -> None:
    row = model_version(store, version="v1.0.0-aaaaaaa-bbbbbbb", mlflow_model_version="1")
    next_version = "v1.0.1-aaaaaaa-bbbbbbb"
    first = move(store, "champion", "1", row.version)
    second = move(
        store, "champion", "2", next_version, previous_registry_version="1", previous_model_version=row.version
    )
    third = move(store, "challenger", "2", next_version)
    back = move(store, "challenger", "1", None, previous_registry_version="2", previous_model_version=next_version)
    with store.session() as session:
        assert [m.id for m in alias_history(session, "pcb-defects")] == [back.id, third.id, second.id, first.id]
        assert [m.id for m in alias_history(session, "pcb-defects", "champion")] == [second.id, first.id]
        assert [m.id for m in alias_history(session, "pcb-defects", limit=1)] == [back.id]
        assert len(alias_history(session, "pcb-defects", limit=None)) == 4
        assert alias_history(session, "wafers") == []
        assert [m.id for m in alias_changes_for_version(session, "pcb-defects", "1")] == [first.id, second.id, back.id]
        # By version string, and by registry number for the move that carried none.
        assert [m.id for m in alias_changes_for_model_version(session, row)] == [first.id, second.id, back.id]


def test_an_alias_move_needs_an_actor_a_reason_and_a_real_run(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="actor is empty: say who moved the alias"):
        move(store, "champion", "1", None, actor=" ")
    with store.session() as session, pytest.raises(ValueError, match="reason is empty: say why the alias moved"):
        record_alias_change(
            session,
            model_name="pcb-defects",
            alias="champion",
            registry_version="1",
            model_version=None,
            previous_registry_version=None,
            previous_model_version=None,
            actor="alice",
            reason="",
        )
    with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
        move(store, "champion", "1", None, pipeline_run_id=999)
    assert count(store, AliasChange) == 0
