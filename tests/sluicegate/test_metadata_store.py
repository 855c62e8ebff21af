"""The metadata store itself (sessions, foreign keys, the schema check, unreachable databases, how a store is
opened), on SQLite and on a real PostgreSQL. Its repository functions are tested per aggregate beside this."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from sluicegate.errors import SchemaOutdated, StoreUnavailable
from sluicegate.metadata import Dataset, GateResult, MetadataStore
from sluicegate.metadata.datasets import get_or_create_dataset
from tests.fixtures.metadata import count
from tests.fixtures.postgres import free_port

# --- the store itself -----------------------------------------------------------------------------------


def test_session_rolls_back_on_error(store: MetadataStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.session() as session:
        get_or_create_dataset(session, "pcb")
        raise RuntimeError("boom")
    assert count(store, Dataset) == 0


def test_foreign_keys_are_enforced_on_both_backends(store: MetadataStore) -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), store.session() as session:
        session.add(GateResult(pipeline_run_id=12345, gate="g", passed=True, metrics={}))


def test_check_schema_on_an_unmigrated_database(store_url: str) -> None:
    store = MetadataStore(store_url)
    try:
        assert store.current_revision() is None
        with pytest.raises(SchemaOutdated, match=r"has no sluicegate schema .*run `sluicegate db upgrade`"):
            store.check_schema()
        # Using the store anyway names the same fix on both backends, not a driver error.
        with pytest.raises(SchemaOutdated, match="sluicegate db upgrade"), store.session() as session:
            get_or_create_dataset(session, "pcb")
        store.upgrade()
        store.check_schema()
    finally:
        store.dispose()


def test_check_schema_on_a_database_newer_than_the_code(store: MetadataStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff9999'"))
    with pytest.raises(SchemaOutdated, match=r"is at revision ffff9999, newer than .*upgrade sluicegate"):
        store.check_schema()


def test_check_schema_on_an_older_database(store: MetadataStore) -> None:
    store.downgrade("0001")
    with pytest.raises(SchemaOutdated, match=r"is at revision 0001, expected 0002; run `sluicegate db upgrade`"):
        store.check_schema()


def test_unreachable_postgres_names_the_url_without_the_password() -> None:
    store = MetadataStore(f"postgresql+psycopg://u:secret@127.0.0.1:{free_port()}/x")
    try:
        with pytest.raises(StoreUnavailable) as caught, store.session() as session:
            session.execute(text("SELECT 1"))
        message = str(caught.value)
        assert "secret" not in message
        assert "postgresql+psycopg://u:***@127.0.0.1:" in message
        assert "unreachable" in message and "SLUICEGATE_METADATA__URL" in message
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.check_schema()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.upgrade()
    finally:
        store.dispose()
    assert store.url_redacted.endswith("/x") and "secret" not in store.url_redacted


def test_unopenable_sqlite_file_is_unavailable(tmp_path: Path) -> None:
    store = MetadataStore(f"sqlite:///{tmp_path}")  # a directory, not a file
    try:
        with pytest.raises(StoreUnavailable, match=f"metadata store at sqlite:///{tmp_path} is unreachable"):
            store.current_revision()
    finally:
        store.dispose()


def test_sqlite_parent_directory_is_created_and_wal_is_on(tmp_path: Path) -> None:
    store = MetadataStore(f"sqlite:///{tmp_path / 'state' / 'nested' / 'metadata.db'}")
    try:
        assert (tmp_path / "state" / "nested").is_dir()
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        store.dispose()


# --- opening a store ------------------------------------------------------------------------------------


def test_checked_refuses_a_store_that_is_not_current(store_url: str) -> None:
    message = r"has no sluicegate schema .*run `sluicegate db upgrade`"
    with pytest.raises(SchemaOutdated, match=message), MetadataStore.checked(store_url):
        pytest.fail("a store without the schema was handed out")
    with MetadataStore.unchecked(store_url) as store:  # what `sluicegate db upgrade` opens
        assert store.current_revision() is None
        store.upgrade()
    with MetadataStore.checked(store_url) as store:
        assert store.current_revision() == store.head_revision()
        assert count(store, Dataset) == 0
        assert store.engine.pool.checkedin() == 1  # the connection the count used, back in the pool
    assert store.engine.pool.checkedin() == 0  # disposed on the way out
