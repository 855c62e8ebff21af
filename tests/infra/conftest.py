"""Fixtures of the compose tests (test_compose*.py): the compose file as compose reads it, and settings
built from one service's environment. The helper modules beside the tests (compose_file, k8s_manifests)
assert too: pytest explains their failures as it does the tests'."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.register_assert_rewrite("tests.infra.compose_file", "tests.infra.k8s_manifests")

from sluicegate.settings import Settings  # noqa: E402
from tests.infra.compose_file import load  # noqa: E402


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture
def platform_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Sets a service's environment (and only it) as the process environment, then builds Settings."""

    def apply(env: dict[str, str]) -> Settings:
        for name in list(os.environ):
            if name.startswith(("SLUICEGATE_", "PREFECT_", "MLFLOW_", "AWS_")):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return Settings()

    yield apply
