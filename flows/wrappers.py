"""How flows wrap the plain functions of tasks/ as Prefect tasks, with one set of defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from sluicegate.transient import is_transient

P = ParamSpec("P")
R = TypeVar("R")

# Retry policy of steps that talk to S3, MLflow or the metadata store over the network, for a dependency
# that is away for a while (a restart, a failover, a dropped connection). Delays 2, 4, 8, 16, 32 s: six
# attempts over about a minute of waiting, enough for a server restart or a database failover; an
# outage that lasts is reported within two minutes. Each delay is jittered (mean kept, between 0.63x and
# 1.5x) so the stages of parallel runs that failed together do not come back together. Only transient
# failures are retried (`is_transient`): a bug, bad input, a 4xx answer or a failed gate fails the stage
# at once. The clients retry underneath, per call: botocore (standard mode, 5 attempts, at most ~15 s
# of backoff) and MLflow's HTTP session (MLFLOW_HTTP_REQUEST_MAX_RETRIES, ~4 min by default: run
# flows with 2, a few seconds, so that this policy owns the long window).
NETWORK_RETRIES = 5
NETWORK_BACKOFF_S = 2.0
NETWORK_RETRY_JITTER = 0.5


def retry_if_transient(_task: Task[..., Any], _task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry a failed stage only if its exception is transient.

    Prefect hands the exception over as the Failed state's data; a stage that returns a Failed state
    itself (none of ours does) is not retried.
    """
    failure = getattr(state, "data", None)
    return isinstance(failure, BaseException) and is_transient(failure)


def stage(fn: Callable[P, R], name: str, *, network: bool = True) -> Task[P, R]:
    """A Prefect task around ``fn``.

    Idempotency lives in the metadata store's keys, not in Prefect's input-hash cache (inputs here
    carry clients and stores that cannot be hashed anyway), hence ``NO_CACHE``.

    Args:
        fn: the stage's logic, a plain function of tasks/ (or a thin adapter in flows/).
        name: the task's name in Prefect.
        network: the stage talks to a network dependency; transient failures are retried with the
            backoff above. A local stage (training, conversion) fails at its first error.

    Returns:
        The Prefect task; calling it inside a flow runs ``fn`` as a task run.
    """
    if not network:
        return task(name=name, cache_policy=NO_CACHE, retries=0)(fn)
    return task(
        name=name,
        cache_policy=NO_CACHE,
        retries=NETWORK_RETRIES,
        retry_delay_seconds=exponential_backoff(backoff_factor=NETWORK_BACKOFF_S),
        retry_jitter_factor=NETWORK_RETRY_JITTER,
        retry_condition_fn=retry_if_transient,
    )(fn)
