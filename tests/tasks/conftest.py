"""Fixtures of the Kubernetes rollout platform's tests (test_rollout_kubernetes*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tasks.kmock_cluster import Cluster  # assertions rewritten: registered in tests/conftest.py


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster()
    try:
        yield running
    finally:
        running.close()
