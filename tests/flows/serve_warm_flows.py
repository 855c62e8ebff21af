"""The runner process of tests/flows/test_warm_runner.py: ``python -m tests.flows.serve_warm_flows SUFFIX
POLL_SECONDS`` serves the flows of tests/flows/warm_flows.py (deployments named ``<flow>-SUFFIX``) on the
Prefect API in ``PREFECT_API_URL`` with the warm runner, as ``python -m flows.deployments`` serves the
pipeline."""

from __future__ import annotations

import logging
import sys
from typing import cast

from prefect.deployments.runner import RunnerDeployment
from prefect.types.entrypoint import EntrypointType

from flows.warm_runner import serve_warm
from tests.flows.warm_flows import crash, probe, wait_for

# Above the tests' peak (3 runs in flight, plus runs whose final state the API already has while their
# processes are still being reaped: a slot is freed only then). The runner here polls once, so a run
# skipped at capacity would wait for a poll that never comes; the stack polls every 5 s and picks it up.
LIMIT = 8


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    suffix, poll_seconds = sys.argv[1], float(sys.argv[2])
    # Called outside an event loop, to_deployment returns the deployment itself (not a coroutine).
    deployments = [
        cast(RunnerDeployment, f.to_deployment(name=f"{f.name}-{suffix}", entrypoint_type=EntrypointType.MODULE_PATH))
        for f in (probe, crash, wait_for)
    ]
    serve_warm(deployments, poll_seconds=poll_seconds, limit=LIMIT)


if __name__ == "__main__":
    main()
