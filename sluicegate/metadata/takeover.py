"""Re-running a pipeline on a dataset version: find the earlier run it repeats, and take over an abandoned one.

A run killed mid-way (OOM, node lost, a worker restart) leaves its row ``running``; a new flow run on the
same dataset version with the same code takes that row over, so its MLflow run, model version, registry
version and gate rows are found again by their keys instead of duplicated. Whether the earlier run is
abandoned or still going is the orchestrator's knowledge; the caller asks it and passes the answer in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import PipelineRun

# What identifies "the same dataset version" in a run's parameters: the manifest and its exact version.
IDENTITY = ("bucket", "key", "version_id")


def same_input(parameters: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(str(parameters.get(name) or "") == str(other.get(name) or "") for name in IDENTITY)


def unfinished_runs_like(
    session: Session, *, code_version: str, parameters: Mapping[str, Any], exclude_flow_run_id: str | None
) -> list[PipelineRun]:
    """Runs still marked ``running`` on the same manifest version with the same code, oldest first.

    Args:
        session: An open session.
        code_version: The git commit the new run has; a run of other code is another build, not a repeat.
        parameters: The new run's flow parameters (``bucket``, ``key``, ``version_id`` are compared).
        exclude_flow_run_id: The new run's own flow run id.
    """
    query = (
        select(PipelineRun)
        .where(PipelineRun.status == "running", PipelineRun.code_version == code_version)
        .order_by(PipelineRun.id)
    )
    return [
        run
        for run in session.scalars(query)
        if run.prefect_flow_run_id != exclude_flow_run_id and same_input(run.parameters, parameters)
    ]


def take_over(
    session: Session, run: PipelineRun, *, prefect_flow_run_id: str | None, previous_state: str
) -> PipelineRun:
    """Make ``run`` the row of the new flow run; the abandoned flow run's id and state stay in its parameters.

    Args:
        session: An open session.
        run: The abandoned run (from ``unfinished_runs_like``).
        prefect_flow_run_id: The new flow run's id.
        previous_state: How the orchestrator last saw the abandoned flow run (e.g. ``CRASHED``).

    Returns:
        The same row, now pointing at the new flow run, ``running`` again.
    """
    history = list(run.parameters.get("taken_over_from", []))
    history.append({"flow_run_id": run.prefect_flow_run_id, "state": previous_state})
    run.parameters = {**run.parameters, "taken_over_from": history}
    run.prefect_flow_run_id = prefect_flow_run_id
    run.status, run.reason, run.finished_at = "running", None, None
    session.flush()
    return run
