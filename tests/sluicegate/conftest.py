from __future__ import annotations

from collections.abc import Iterator

import pytest

from sluicegate.metadata import MetadataStore


@pytest.fixture
def store(store_url: str) -> Iterator[MetadataStore]:
    """A migrated, empty store, once on SQLite and once on a throwaway PostgreSQL (``store_url``)."""
    store = MetadataStore(store_url)
    store.upgrade()
    yield store
    store.dispose()
