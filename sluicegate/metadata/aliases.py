"""Repository functions for registry alias moves (the ``alias_changes`` table)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import AliasChange, PipelineRun, utcnow


def record_alias_change(
    session: Session,
    *,
    model_name: str,
    alias: str,
    registry_version: str | None,
    model_version: str | None,
    previous_registry_version: str | None,
    previous_model_version: str | None,
    actor: str,
    reason: str,
    pipeline_run_id: int | None = None,
) -> AliasChange:
    """Record that ``alias`` of ``model_name`` moved (``registry_version`` None: it was removed).

    Raises:
        ValueError: ``actor`` or ``reason`` is empty (a move nobody can explain is not recorded).
        LookupError: ``pipeline_run_id`` does not exist.
    """
    if not actor.strip():
        raise ValueError("actor is empty: say who moved the alias")
    if not reason.strip():
        raise ValueError("reason is empty: say why the alias moved")
    if pipeline_run_id is not None and session.get(PipelineRun, pipeline_run_id) is None:
        raise LookupError(f"pipeline run {pipeline_run_id} does not exist")
    row = AliasChange(
        model_name=model_name,
        alias=alias,
        registry_version=registry_version,
        model_version=model_version,
        previous_registry_version=previous_registry_version,
        previous_model_version=previous_model_version,
        actor=actor,
        reason=reason,
        pipeline_run_id=pipeline_run_id,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return row


def alias_history(
    session: Session, model_name: str, alias: str | None = None, *, limit: int = 100
) -> list[AliasChange]:
    """Alias moves of a model, newest first (optionally of one alias)."""
    query = select(AliasChange).where(AliasChange.model_name == model_name)
    if alias is not None:
        query = query.where(AliasChange.alias == alias)
    return list(session.scalars(query.order_by(AliasChange.created_at.desc(), AliasChange.id.desc()).limit(limit)))


def alias_changes_for_version(session: Session, model_name: str, registry_version: str) -> list[AliasChange]:
    """Moves onto or off ``registry_version``, oldest first."""
    query = select(AliasChange).where(
        AliasChange.model_name == model_name,
        (AliasChange.registry_version == registry_version)
        | (AliasChange.previous_registry_version == registry_version),
    )
    return list(session.scalars(query.order_by(AliasChange.created_at, AliasChange.id)))
