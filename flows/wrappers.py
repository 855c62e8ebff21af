"""How flows wrap the plain functions of tasks/ as Prefect tasks, with one set of defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

P = ParamSpec("P")
R = TypeVar("R")

# Backoff for steps that talk to S3, MLflow, Prefect or the metadata store over the network.
NETWORK_RETRY_DELAYS = [1.0, 4.0, 10.0]


def stage(fn: Callable[P, R], name: str, *, network: bool = True) -> Task[P, R]:
    """A Prefect task around ``fn``.

    Idempotency lives in the metadata store's keys, not in Prefect's input-hash cache (inputs here
    carry clients and stores that cannot be hashed anyway), hence ``NO_CACHE``.
    """
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=len(NETWORK_RETRY_DELAYS) if network else 0,
        retry_delay_seconds=NETWORK_RETRY_DELAYS if network else 0,
    )(fn)
