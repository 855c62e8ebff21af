"""Repository functions for gate verdicts (the ``gate_results`` table): one row per (pipeline run, gate)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import GateResult, PipelineRun, utcnow
from sluicegate.metadata.rows import require


def record_gate_result(
    session: Session,
    *,
    pipeline_run_id: int,
    gate: str,
    passed: bool,
    metrics: Mapping[str, Any],
    report_uri: str | None = None,
) -> GateResult:
    """Record a gate's verdict for a run; a repeated gate replaces its earlier result.

    Args:
        session: An open session.
        pipeline_run_id: The pipeline run.
        gate: The gate's name (e.g. ``"data-gate"``).
        passed: The verdict.
        metrics: Observed values and thresholds (JSON-serialisable; NaN/inf are stored as strings).
        report_uri: Where the gate's report lives, if it wrote one.

    Returns:
        The one row for (run, gate).

    Raises:
        LookupError: the run does not exist.
    """
    require(session, PipelineRun, pipeline_run_id, "pipeline run")
    found = session.scalars(
        select(GateResult).where(GateResult.pipeline_run_id == pipeline_run_id, GateResult.gate == gate)
    ).one_or_none()
    if found is None:
        found = GateResult(pipeline_run_id=pipeline_run_id, gate=gate, created_at=utcnow())
        session.add(found)
    found.passed, found.metrics, found.report_uri = passed, dict(metrics), report_uri
    session.flush()
    return found


def gate_results_for_run(session: Session, run_id: int) -> list[GateResult]:
    """A run's gate results in the order they were first recorded.

    Args:
        session: An open session.
        run_id: The pipeline run.

    Returns:
        The results (empty when none).
    """
    query = select(GateResult).where(GateResult.pipeline_run_id == run_id).order_by(GateResult.id)
    return list(session.scalars(query))


def recent_gate_results(
    session: Session, gate: str, *, passed_only: bool = True, exclude_run_id: int | None = None, limit: int = 50
) -> list[GateResult]:
    """The most recent results of one gate across runs, newest first (a gate's history).

    Args:
        session: An open session.
        gate: Gate name, e.g. "train".
        passed_only: Only results that passed (a failed run is not a reference).
        exclude_run_id: Leave out this run (the one being judged).
        limit: At most this many.

    Returns:
        The results, newest first.
    """
    query = select(GateResult).where(GateResult.gate == gate)
    if passed_only:
        query = query.where(GateResult.passed.is_(True))
    if exclude_run_id is not None:
        query = query.where(GateResult.pipeline_run_id != exclude_run_id)
    return list(session.scalars(query.order_by(GateResult.id.desc()).limit(limit)))
