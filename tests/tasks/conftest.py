"""Fixtures of the Kubernetes rollout platform's tests (test_rollout_kubernetes*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# The cluster module asserts in its readers: pytest explains those failures as it does the tests'.
pytest.register_assert_rewrite("tests.tasks.kmock_cluster")

from tests.tasks.kmock_cluster import Cluster  # noqa: E402


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster()
    try:
        yield running
    finally:
        running.close()
