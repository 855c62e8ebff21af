"""Repository functions for model versions (``model_versions``) and the moves of their registry aliases
(``alias_changes``: who pointed ``champion`` or ``challenger`` where, from what, and why)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import AliasChange, DatasetVersion, ModelVersion, PipelineRun, utcnow
from sluicegate.metadata.rows import check_code_version, check_hex, require

# --- model versions -------------------------------------------------------------------------------------


def record_model_version(
    session: Session,
    *,
    model_name: str,
    version: str,
    mlflow_run_id: str,
    code_version: str,
    data_version: str,
    artifacts: Mapping[str, str],
    environment: Mapping[str, Any],
    pipeline_run_id: int | None = None,
    dataset_version_id: int | None = None,
    mlflow_model_version: str | None = None,
) -> ModelVersion:
    """Record a model version; recording the same (model_name, version) again updates that row.

    A retried run rebuilds the same version string (same commit and data) and its last attempt's
    artifacts are the ones registered, so the last record wins rather than the first.

    Args:
        session: An open session.
        model_name: Registered model name.
        version: ``v{MAJOR}.{MINOR}.{PATCH}-{commit7}-{data7}``.
        mlflow_run_id: The MLflow run that produced it.
        code_version: The git commit (40 hex characters) or ``"unknown"``.
        data_version: sha256 of the training dataset's manifest.
        artifacts: File name -> sha256 of each artifact.
        environment: Library, driver and GPU versions it was built with.
        pipeline_run_id: The pipeline run that produced it, if any.
        dataset_version_id: The dataset version it was trained on, if recorded.
        mlflow_model_version: The MLflow registry version, once registered.

    Returns:
        The one row for (model_name, version).

    Raises:
        ValueError: ``code_version`` or ``data_version`` is malformed.
        LookupError: ``pipeline_run_id`` or ``dataset_version_id`` does not exist.
    """
    check_code_version(code_version)
    check_hex("data_version", data_version, 64)
    if pipeline_run_id is not None:
        require(session, PipelineRun, pipeline_run_id, "pipeline run")
    if dataset_version_id is not None:
        require(session, DatasetVersion, dataset_version_id, "dataset version")
    found = find_model_version(session, model_name, version)
    if found is None:
        found = ModelVersion(model_name=model_name, version=version, created_at=utcnow())
        session.add(found)
    found.mlflow_run_id, found.mlflow_model_version = mlflow_run_id, mlflow_model_version
    found.code_version, found.data_version = code_version, data_version
    found.artifacts, found.environment = dict(artifacts), dict(environment)
    found.pipeline_run_id, found.dataset_version_id = pipeline_run_id, dataset_version_id
    session.flush()
    return found


def find_model_version(session: Session, model_name: str, version: str) -> ModelVersion | None:
    """The recorded model version ``version`` (``vX.Y.Z-<commit7>-<data7>``) of ``model_name``, or None."""
    query = select(ModelVersion).where(ModelVersion.model_name == model_name, ModelVersion.version == version)
    return session.scalars(query).one_or_none()


def find_model_versions(session: Session, ref: str, model_name: str | None = None) -> list[ModelVersion]:
    """Recorded model versions named ``ref`` exactly, else those starting with it (at most 6).

    When several models share the matches, those of ``model_name`` (the configured model) win.
    """
    exact = list(session.scalars(select(ModelVersion).where(ModelVersion.version == ref).order_by(ModelVersion.id)))
    found = exact or list(
        session.scalars(
            select(ModelVersion)
            .where(ModelVersion.version.startswith(ref, autoescape=True))
            .order_by(ModelVersion.id)
            .limit(6)
        )
    )
    preferred = [row for row in found if row.model_name == model_name]
    return preferred if preferred and len({row.model_name for row in found}) > 1 else found


def model_version_for_run(session: Session, pipeline_run_id: int) -> ModelVersion | None:
    """The (first recorded) model version a pipeline run produced, or None when it produced none."""
    query = select(ModelVersion).where(ModelVersion.pipeline_run_id == pipeline_run_id).order_by(ModelVersion.id)
    return session.scalars(query).first()


def model_versions_for_dataset_version(session: Session, version: DatasetVersion) -> list[ModelVersion]:
    """Model versions trained on ``version`` (linked to its row, or carrying its data version), oldest first."""
    query = (
        select(ModelVersion)
        .where(or_(ModelVersion.dataset_version_id == version.id, ModelVersion.data_version == version.data_version))
        .order_by(ModelVersion.created_at, ModelVersion.id)
    )
    return list(session.scalars(query))


# --- alias moves ----------------------------------------------------------------------------------------


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
    session: Session, model_name: str, alias: str | None = None, *, limit: int | None = 100
) -> list[AliasChange]:
    """Alias moves of a model, newest first (optionally of one alias; ``limit`` None: every move)."""
    query = select(AliasChange).where(AliasChange.model_name == model_name)
    if alias is not None:
        query = query.where(AliasChange.alias == alias)
    query = query.order_by(AliasChange.created_at.desc(), AliasChange.id.desc())
    return list(session.scalars(query if limit is None else query.limit(limit)))


def alias_changes_for_version(session: Session, model_name: str, registry_version: str) -> list[AliasChange]:
    """Moves onto or off ``registry_version``, oldest first."""
    query = select(AliasChange).where(
        AliasChange.model_name == model_name,
        (AliasChange.registry_version == registry_version)
        | (AliasChange.previous_registry_version == registry_version),
    )
    return list(session.scalars(query.order_by(AliasChange.created_at, AliasChange.id)))


def alias_changes_for_model_version(session: Session, row: ModelVersion) -> list[AliasChange]:
    """Moves onto or off a recorded model version, by its version string or its registry number, oldest first."""
    conditions: list[ColumnElement[bool]] = [
        AliasChange.model_version == row.version,
        AliasChange.previous_model_version == row.version,
    ]
    if row.mlflow_model_version:
        conditions.append(AliasChange.registry_version == row.mlflow_model_version)
        conditions.append(AliasChange.previous_registry_version == row.mlflow_model_version)
    query = (
        select(AliasChange)
        .where(AliasChange.model_name == row.model_name, or_(*conditions))
        .order_by(AliasChange.created_at, AliasChange.id)
    )
    return list(session.scalars(query))
