"""Repository functions for pipeline runs (the ``pipeline_runs`` table), and a run's bookkeeping on a store.

Session-level functions take the caller's session. ``begin_run``, ``attach_dataset_version``,
``attach_mlflow_run`` and ``finish_run`` each run one transaction on a store: the pipeline flow's stages.

Re-running a pipeline on a dataset version: a run killed mid-way (OOM, node lost, a worker restart) leaves
its row ``running``; a new flow run on the same dataset version with the same code takes that row over, so
its MLflow run, model version, registry version and gate rows are found again by their keys instead of
duplicated. Whether the earlier run is abandoned or still going is the orchestrator's knowledge: the caller
passes a function that asks it (``run_state``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.datasets import find_dataset_version, upsert_dataset_version
from sluicegate.metadata.models import RUN_STATUSES, TRIGGERS, DatasetVersion, PipelineRun, utcnow
from sluicegate.metadata.rows import check_choice, check_code_version, require
from sluicegate.metadata.store import MetadataStore

FINISHED_RUN = tuple(s for s in RUN_STATUSES if s != "running")

# Prefect state types of a flow run that is still going (or about to); any other means it ended.
ACTIVE_STATES = ("RUNNING", "PENDING", "SCHEDULED", "PAUSED", "CANCELLING")

# What identifies "the same dataset version" in a run's parameters: the manifest and its exact version.
IDENTITY = ("bucket", "key", "version_id")


def start_pipeline_run(
    session: Session,
    *,
    prefect_flow_run_id: str | None,
    trigger: str,
    trigger_event_id: str | None,
    code_version: str,
    code_dirty: bool,
    parameters: Mapping[str, Any],
) -> PipelineRun:
    """Record the start of a pipeline run, or the restart of a retried one.

    Args:
        session: An open session.
        prefect_flow_run_id: The Prefect flow run id; None for a run outside Prefect (always a new row).
        trigger: ``"event"``, ``"schedule"`` or ``"manual"``.
        trigger_event_id: Id of the Prefect event that triggered it, if any.
        code_version: The git commit (40 hex characters) or ``"unknown"``.
        code_dirty: Whether the working tree had uncommitted changes.
        parameters: The flow parameters (JSON-serialisable).

    Returns:
        The run's row. For a flow run id seen before, the earlier row with status ``"running"`` again
        and its reason and finish time cleared.

    Raises:
        ValueError: ``trigger`` or ``code_version`` is invalid.
    """
    check_choice("trigger", trigger, TRIGGERS)
    check_code_version(code_version)
    found = None if prefect_flow_run_id is None else pipeline_run_for_flow_run(session, prefect_flow_run_id)
    if found is not None:
        found.status, found.reason, found.finished_at = "running", None, None
        return found
    run = PipelineRun(
        prefect_flow_run_id=prefect_flow_run_id,
        trigger=trigger,
        trigger_event_id=trigger_event_id,
        code_version=code_version,
        code_dirty=code_dirty,
        parameters=dict(parameters),
        status="running",
        started_at=utcnow(),
    )
    session.add(run)
    session.flush()
    return run


def set_pipeline_run_dataset(session: Session, run_id: int, dataset_version_id: int) -> PipelineRun:
    """Link a run to the dataset version it resolved.

    Args:
        session: An open session.
        run_id: The pipeline run.
        dataset_version_id: The dataset version it trains on.

    Returns:
        The updated run.

    Raises:
        LookupError: the run or the dataset version does not exist.
    """
    run = require(session, PipelineRun, run_id, "pipeline run")
    require(session, DatasetVersion, dataset_version_id, "dataset version")
    run.dataset_version_id = dataset_version_id
    return run


def set_pipeline_run_mlflow(session: Session, run_id: int, mlflow_run_id: str) -> PipelineRun:
    """Link a run to its MLflow run.

    Args:
        session: An open session.
        run_id: The pipeline run.
        mlflow_run_id: The MLflow run id.

    Returns:
        The updated run.

    Raises:
        LookupError: the run does not exist.
    """
    run = require(session, PipelineRun, run_id, "pipeline run")
    run.mlflow_run_id = mlflow_run_id
    return run


def finish_pipeline_run(session: Session, run_id: int, *, status: str, reason: str | None = None) -> PipelineRun:
    """Record how a run ended.

    Args:
        session: An open session.
        run_id: The pipeline run.
        status: ``"succeeded"``, ``"failed"`` or ``"skipped"``.
        reason: Why it failed or was skipped, for people reading the lineage.

    Returns:
        The updated run, with its finish time set to now.

    Raises:
        ValueError: ``status`` is not a final status.
        LookupError: the run does not exist.
    """
    check_choice("status", status, FINISHED_RUN)
    run = require(session, PipelineRun, run_id, "pipeline run")
    run.status, run.reason, run.finished_at = status, reason, utcnow()
    return run


def pipeline_run_for_flow_run(session: Session, prefect_flow_run_id: str) -> PipelineRun | None:
    """The run recorded for a Prefect flow run id, or None."""
    query = select(PipelineRun).where(PipelineRun.prefect_flow_run_id == prefect_flow_run_id)
    return session.scalars(query).one_or_none()


def pipeline_runs_for_dataset_version(session: Session, dataset_version_id: int) -> list[PipelineRun]:
    """Runs that trained on a dataset version, oldest first.

    Args:
        session: An open session.
        dataset_version_id: The dataset version.

    Returns:
        The runs (empty when none).
    """
    query = (
        select(PipelineRun)
        .where(PipelineRun.dataset_version_id == dataset_version_id)
        .order_by(PipelineRun.started_at, PipelineRun.id)
    )
    return list(session.scalars(query))


# --- taking over an abandoned run -----------------------------------------------------------------------


def same_input(parameters: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two runs' parameters name the same manifest version (``IDENTITY``)."""
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


# --- a pipeline run's bookkeeping, one transaction each -------------------------------------------------


@dataclass(frozen=True)
class RunStart:
    """Which row a starting flow run got (``begin_run``)."""

    run_id: int
    taken_over: str | None = None  # the abandoned flow run this one continues ("unknown" when it had no id)
    busy_with: str | None = None  # a live flow run already on this dataset version


def begin_run(
    store: MetadataStore,
    *,
    flow_run_id: str | None,
    trigger: str,
    event_id: str | None,
    code_commit: str,
    code_dirty: bool,
    parameters: dict[str, Any],
    run_state: Callable[[str | None], str],
) -> RunStart:
    """This flow run's row: its own again when the orchestrator retries it; an abandoned run's on the same
    dataset version when that one's process died; or a new one, noting a live run on the same version.

    Args:
        store: The metadata store.
        flow_run_id: The Prefect flow run id; None for a run outside Prefect.
        trigger: ``"event"``, ``"schedule"`` or ``"manual"``.
        event_id: Id of the Prefect event that triggered it, if any.
        code_commit: The git commit (40 hex characters) or ``"unknown"``.
        code_dirty: Whether the working tree had uncommitted changes.
        parameters: The flow parameters; ``bucket``, ``key``, ``version_id`` identify the dataset version.
        run_state: Prefect flow run id (or None) -> its state type name (``RUNNING``, ``CRASHED``, ...),
            ``"MISSING"`` when the orchestrator no longer knows it. A state in ``ACTIVE_STATES`` is live.

    Returns:
        The row's id, and the flow run taken over or the live one found, if any.

    Raises:
        ValueError: ``trigger`` or ``code_commit`` is invalid.
    """
    with store.session() as session:
        seen = flow_run_id is not None and pipeline_run_for_flow_run(session, flow_run_id) is not None
        taken, busy = (
            (None, None) if seen else _continue_abandoned(session, flow_run_id, code_commit, parameters, run_state)
        )
        if taken is not None:
            return taken
        row = start_pipeline_run(
            session,
            prefect_flow_run_id=flow_run_id,
            trigger=trigger,
            trigger_event_id=event_id,
            code_version=code_commit,
            code_dirty=code_dirty,
            parameters=parameters,
        )
        return RunStart(row.id, busy_with=busy)


def _continue_abandoned(
    session: Session,
    flow_run_id: str | None,
    code_commit: str,
    parameters: Mapping[str, Any],
    run_state: Callable[[str | None], str],
) -> tuple[RunStart | None, str | None]:
    """The first abandoned run like this one, taken over (or None), and the live flow run like it (or None)."""
    busy: str | None = None
    for earlier in unfinished_runs_like(
        session, code_version=code_commit, parameters=parameters, exclude_flow_run_id=flow_run_id
    ):
        state = run_state(earlier.prefect_flow_run_id)
        if state in ACTIVE_STATES:
            busy = earlier.prefect_flow_run_id
            continue
        previous = earlier.prefect_flow_run_id
        take_over(session, earlier, prefect_flow_run_id=flow_run_id, previous_state=state)
        return RunStart(earlier.id, taken_over=previous or "unknown"), busy
    return None, busy


def attach_dataset_version(
    store: MetadataStore,
    run_id: int,
    *,
    dataset_name: str,
    data_version: str,
    bucket: str,
    prefix: str,
    manifest_key: str,
    manifest_etag: str,
    manifest_version_id: str | None,
    objects: Mapping[str, Mapping[str, Any]],
) -> int:
    """Record the dataset version a run resolved (``upsert_dataset_version``) and link the run to it.

    Returns:
        The dataset version's row id.

    Raises:
        ValueError: ``data_version`` is not a sha256 hex digest.
        LookupError: the run does not exist.
    """
    with store.session() as session:
        version = upsert_dataset_version(
            session,
            dataset_name=dataset_name,
            data_version=data_version,
            bucket=bucket,
            prefix=prefix,
            manifest_key=manifest_key,
            manifest_etag=manifest_etag,
            manifest_version_id=manifest_version_id,
            objects=objects,
        )
        set_pipeline_run_dataset(session, run_id, version.id)
        return version.id


def attach_mlflow_run(store: MetadataStore, run_id: int, mlflow_run_id: str) -> None:
    """Link a run to its MLflow run (``set_pipeline_run_mlflow``)."""
    with store.session() as session:
        set_pipeline_run_mlflow(session, run_id, mlflow_run_id)


def finish_run(store: MetadataStore, run_id: int, status: str, reason: str | None) -> None:
    """Record how a run ended (``finish_pipeline_run``)."""
    with store.session() as session:
        finish_pipeline_run(session, run_id, status=status, reason=reason)


def record_skipped_run(
    store: MetadataStore,
    *,
    flow_run_id: str | None,
    trigger: str,
    code_commit: str,
    code_dirty: bool,
    parameters: dict[str, Any],
    data_version: str | None,
    reason: str,
) -> int:
    """A run that decided not to run (a scheduled retrain whose newest data already made the champion):
    recorded as ``skipped`` with its reason and linked to the dataset version, so lineage shows it."""

    with store.session() as session:
        row = start_pipeline_run(
            session,
            prefect_flow_run_id=flow_run_id,
            trigger=trigger,
            trigger_event_id=None,
            code_version=code_commit,
            code_dirty=code_dirty,
            parameters=parameters,
        )
        version = find_dataset_version(session, data_version) if data_version else None
        if version is not None:
            set_pipeline_run_dataset(session, row.id, version.id)
        finish_pipeline_run(session, row.id, status="skipped", reason=reason)
        return row.id
