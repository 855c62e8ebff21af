"""Alembic migrations of the metadata store, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, inspect

from sluicegate.metadata import Base, MetadataStore
from sluicegate.metadata.store import MIGRATIONS_DIR

TABLES = {
    "alias_changes",
    "datasets",
    "dataset_versions",
    "pipeline_runs",
    "gate_results",
    "model_versions",
    "deployments",
    "rollout_steps",
    "s3_events",
    "dead_letters",
}


@pytest.fixture
def store(store_url: str) -> Iterator[MetadataStore]:
    store = MetadataStore(store_url)
    yield store
    store.dispose()


def tables(store: MetadataStore) -> set[str]:
    return set(inspect(store.engine).get_table_names()) - {"alembic_version"}


def differences(store: MetadataStore, metadata: MetaData) -> list[object]:
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, metadata))


def test_upgrade_downgrade_upgrade(store: MetadataStore) -> None:
    assert store.current_revision() is None
    store.upgrade()
    assert tables(store) == TABLES
    assert store.current_revision() == store.head_revision() == "0002"
    store.downgrade("0001")
    assert tables(store) == TABLES - {"alias_changes"}
    store.downgrade("base")
    assert tables(store) == set()
    assert store.current_revision() is None
    store.upgrade("head")
    assert tables(store) == TABLES
    store.check_schema()


def test_upgrade_twice_is_a_no_op(store: MetadataStore) -> None:
    store.upgrade()
    store.upgrade()
    assert store.current_revision() == store.head_revision()


def test_models_and_migrations_agree(store: MetadataStore) -> None:
    store.upgrade()
    assert differences(store, Base.metadata) == []


def test_the_comparison_would_notice_a_drift(store: MetadataStore) -> None:
    # Guards the test above against passing vacuously (e.g. an empty metadata or a misconfigured context).
    store.upgrade()
    drifted = MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["datasets"].append_column(Column("owner", Integer()))
    found = differences(store, drifted)
    assert [entry[:3] for entry in found if isinstance(entry, tuple)] == [("add_column", None, "datasets")]


def test_indexes_where_lookups_happen(store: MetadataStore) -> None:
    store.upgrade()
    inspector = inspect(store.engine)

    def indexed(table: str) -> set[str]:
        return {column for ix in inspector.get_indexes(table) for column in ix["column_names"] if column}

    assert "data_version" in indexed("dataset_versions")
    assert "data_version" in indexed("model_versions")
    assert "dataset_version_id" in indexed("pipeline_runs")
    assert "key" in indexed("s3_events")


def test_migrations_ship_inside_the_package() -> None:
    # script_location is the package folder itself, so an installed wheel needs no alembic.ini.
    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert (MIGRATIONS_DIR / "script.py.mako").is_file()
    assert (MIGRATIONS_DIR / "versions" / "0001_initial.py").is_file()
    assert MIGRATIONS_DIR.parent.name == "sluicegate"
