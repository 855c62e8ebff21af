"""Repository functions for rollouts: deployments of a model version (``deployments``) and their canary
steps (``rollout_steps``: weights, observed metrics, decision).

The session-level functions take the caller's session; ``begin_deployment``, ``record_step`` and
``end_deployment`` each run one transaction on a store, for the rollout flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.model_versions import find_model_version
from sluicegate.metadata.models import (
    DECISIONS,
    DEPLOYMENT_STATUSES,
    PLATFORMS,
    Deployment,
    ModelVersion,
    RolloutStep,
    utcnow,
)
from sluicegate.metadata.rows import check_choice, require
from sluicegate.metadata.store import MetadataStore

FINISHED_DEPLOYMENT = tuple(s for s in DEPLOYMENT_STATUSES if s != "in_progress")


def create_deployment(session: Session, *, model_version_id: int, platform: str, target: str) -> Deployment:
    """Record the start of a rollout of a model version.

    Args:
        session: An open session.
        model_version_id: The model version being rolled out.
        platform: ``"kubernetes"`` or ``"local"``.
        target: What is rolled (e.g. ``namespace/service``).

    Returns:
        A new row, status ``"in_progress"``. Every call is a new rollout attempt: a retried rollout
        should first finish the stale attempt as ``"failed"``.

    Raises:
        ValueError: ``platform`` is unknown.
        LookupError: the model version does not exist.
    """
    check_choice("platform", platform, PLATFORMS)
    require(session, ModelVersion, model_version_id, "model version")
    row = Deployment(
        model_version_id=model_version_id,
        platform=platform,
        target=target,
        status="in_progress",
        started_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return row


def finish_deployment(session: Session, deployment_id: int, *, status: str, reason: str | None = None) -> Deployment:
    """Record how a rollout ended.

    Args:
        session: An open session.
        deployment_id: The deployment.
        status: ``"promoted"``, ``"rolled_back"`` or ``"failed"``.
        reason: Why it was rolled back or failed.

    Returns:
        The updated row, with its finish time set to now.

    Raises:
        ValueError: ``status`` is not a final status.
        LookupError: the deployment does not exist.
    """
    check_choice("status", status, FINISHED_DEPLOYMENT)
    row = require(session, Deployment, deployment_id, "deployment")
    row.status, row.reason, row.finished_at = status, reason, utcnow()
    return row


def record_rollout_step(
    session: Session,
    *,
    deployment_id: int,
    step_index: int,
    canary_weight: int,
    stable_weight: int,
    observed: Mapping[str, Any],
    decision: str,
    reason: str | None = None,
) -> RolloutStep:
    """Record one canary step's weights, observations and decision; a repeated step replaces itself.

    Args:
        session: An open session.
        deployment_id: The deployment.
        step_index: 0-based position in the rollout plan.
        canary_weight: Percent of traffic on the candidate (0-100).
        stable_weight: Percent of traffic on the stable model (0-100).
        observed: Metrics observed at this step (JSON-serialisable).
        decision: ``"pass"``, ``"fail"`` or ``"inconclusive"``.
        reason: Why, in words.

    Returns:
        The one row for (deployment, step_index).

    Raises:
        ValueError: ``decision`` is unknown, or a weight or the index is out of range.
        LookupError: the deployment does not exist.
    """
    check_choice("decision", decision, DECISIONS)
    if step_index < 0:
        raise ValueError(f"step_index must be >= 0, got {step_index}")
    for field, weight in (("canary_weight", canary_weight), ("stable_weight", stable_weight)):
        if not 0 <= weight <= 100:
            raise ValueError(f"{field} must be a percentage between 0 and 100, got {weight}")
    require(session, Deployment, deployment_id, "deployment")
    found = session.scalars(
        select(RolloutStep).where(RolloutStep.deployment_id == deployment_id, RolloutStep.step_index == step_index)
    ).one_or_none()
    if found is None:
        found = RolloutStep(deployment_id=deployment_id, step_index=step_index, created_at=utcnow())
        session.add(found)
    found.canary_weight, found.stable_weight = canary_weight, stable_weight
    found.observed, found.decision, found.reason = dict(observed), decision, reason
    session.flush()
    return found


def deployments_for_model_version(session: Session, model_version_id: int) -> list[Deployment]:
    """Every rollout of a model version, oldest first."""
    query = (
        select(Deployment)
        .where(Deployment.model_version_id == model_version_id)
        .order_by(Deployment.started_at, Deployment.id)
    )
    return list(session.scalars(query))


def latest_deployment(session: Session, model_name: str) -> Deployment | None:
    """The most recently started rollout of any version of ``model_name``, or None when there was none."""
    query = (
        select(Deployment)
        .join(ModelVersion)
        .where(ModelVersion.model_name == model_name)
        .order_by(Deployment.started_at.desc(), Deployment.id.desc())
        .limit(1)
    )
    return session.scalars(query).first()


def rollout_steps_for_run(session: Session, pipeline_run_id: int) -> list[RolloutStep]:
    """The canary steps of every rollout of the model versions a pipeline run produced, in rollout order."""
    query = (
        select(RolloutStep)
        .join(Deployment)
        .join(ModelVersion)
        .where(ModelVersion.pipeline_run_id == pipeline_run_id)
        .order_by(Deployment.id, RolloutStep.step_index)
    )
    return list(session.scalars(query))


# --- one transaction each, for the rollout flow ----------------------------------------------------------


def begin_deployment(
    store: MetadataStore, *, model_name: str, model_version: str, platform: str, target: str
) -> int | None:
    """Record the start of a rollout of the recorded model version ``model_version`` of ``model_name``.

    Returns:
        The new deployment's id; None when that model version is not in the store (nothing recorded).

    Raises:
        ValueError: ``platform`` is unknown.
    """
    with store.session() as session:
        row = find_model_version(session, model_name, model_version)
        if row is None:
            return None
        return create_deployment(session, model_version_id=row.id, platform=platform, target=target).id


def record_step(
    store: MetadataStore,
    deployment_id: int,
    *,
    step_index: int,
    canary_weight: int,
    stable_weight: int,
    observed: Mapping[str, Any],
    decision: str,
    reason: str | None,
) -> None:
    """``record_rollout_step`` in a transaction of its own (each analysis read is kept as it happens)."""
    with store.session() as session:
        record_rollout_step(
            session,
            deployment_id=deployment_id,
            step_index=step_index,
            canary_weight=canary_weight,
            stable_weight=stable_weight,
            observed=observed,
            decision=decision,
            reason=reason,
        )


def end_deployment(store: MetadataStore, deployment_id: int, status: str, reason: str | None) -> None:
    """``finish_deployment`` in a transaction of its own."""
    with store.session() as session:
        finish_deployment(session, deployment_id, status=status, reason=reason)
