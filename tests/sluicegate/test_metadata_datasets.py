"""Datasets and dataset versions in the metadata store, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from datetime import UTC

import pytest

from sluicegate.metadata import Dataset, DatasetVersion, MetadataStore
from sluicegate.metadata.datasets import (
    find_dataset_version,
    get_or_create_dataset,
    latest_dataset_version,
    upsert_dataset_version,
)
from tests.fixtures.metadata import OBJECTS, add_version, count, sha


def test_get_or_create_dataset_is_idempotent(store: MetadataStore) -> None:
    with store.session() as session:
        first = get_or_create_dataset(session, "pcb")
    with store.session() as session:
        second = get_or_create_dataset(session, "pcb")
    assert first.id == second.id
    assert count(store, Dataset) == 1
    assert first.created_at.tzinfo is not None


def test_upsert_dataset_version_round_trips_and_is_idempotent(store: MetadataStore) -> None:
    version = sha("manifest one")
    first = add_version(store, version)
    with store.session() as session:
        second = upsert_dataset_version(
            session,
            dataset_name="pcb",
            data_version=version,
            bucket="other-bucket",
            prefix="elsewhere/",
            manifest_key="elsewhere/manifest.csv",
            manifest_etag='"other"',
            manifest_version_id=None,
            objects={},
        )
    assert second.id == first.id
    assert second.bucket == "sluicegate"  # the existing row comes back unchanged
    assert count(store, DatasetVersion) == 1
    with store.session() as session:
        loaded = session.get(DatasetVersion, first.id)
        assert loaded is not None
        assert loaded.objects == OBJECTS  # nested JSON, unicode keys, None, a size past 2**32
        assert loaded.num_objects == 2
        assert loaded.dataset.name == "pcb"
        assert loaded.created_at.tzinfo == UTC


def test_same_data_version_in_two_datasets_is_two_rows(store: MetadataStore) -> None:
    version = sha("shared manifest")
    assert add_version(store, version, "pcb").id != add_version(store, version, "wafers").id


def test_upsert_dataset_version_rejects_a_malformed_data_version(store: MetadataStore) -> None:
    with store.session() as session, pytest.raises(ValueError, match="data_version must be 64 lowercase hex"):
        upsert_dataset_version(
            session,
            dataset_name="pcb",
            data_version="ABC",
            bucket="b",
            prefix="p/",
            manifest_key="p/manifest.csv",
            manifest_etag='"e"',
            manifest_version_id=None,
            objects={},
        )


def test_find_dataset_version_by_full_hash_and_prefix(store: MetadataStore) -> None:
    version = sha("manifest one")
    row = add_version(store, version)
    with store.session() as session:
        assert_found = [
            find_dataset_version(session, version),
            find_dataset_version(session, version[:7]),
            find_dataset_version(session, version[:12].upper()),
        ]
        assert [found.id if found else None for found in assert_found] == [row.id] * 3
        assert find_dataset_version(session, "0" * 64) is None
        assert find_dataset_version(session, "fffffff") is None


def test_find_dataset_version_rejects_short_or_non_hex_input(store: MetadataStore) -> None:
    with store.session() as session:
        with pytest.raises(ValueError, match="7 to 64 hex characters"):
            find_dataset_version(session, "abc12")
        with pytest.raises(ValueError, match="7 to 64 hex characters"):
            find_dataset_version(session, "v1.0.0-abc1234")


def test_find_dataset_version_reports_an_ambiguous_prefix(store: MetadataStore) -> None:
    first = "abcdef1" + "0" * 57
    second = "abcdef1" + "1" * 57
    add_version(store, first)
    add_version(store, second)
    with store.session() as session:
        with pytest.raises(LookupError, match=r"'abcdef1' is ambiguous: it matches pcb@abcdef100000, pcb@abcdef1111"):
            find_dataset_version(session, "abcdef1")
        found = find_dataset_version(session, "abcdef11")
        assert found is not None and found.data_version == second


def test_latest_dataset_version(store: MetadataStore) -> None:
    with store.session() as session:
        assert latest_dataset_version(session) is None
    add_version(store, sha("one"), "pcb")
    newest_pcb = add_version(store, sha("two"), "pcb")
    newest = add_version(store, sha("three"), "wafers")
    with store.session() as session:
        latest = latest_dataset_version(session)
        latest_pcb = latest_dataset_version(session, "pcb")
        assert latest_dataset_version(session, "missing") is None
    assert latest is not None and latest.id == newest.id
    assert latest_pcb is not None and latest_pcb.id == newest_pcb.id
