"""Tables of the metadata (lineage) store, shared by PostgreSQL and SQLite.

The Alembic migrations in ``sluicegate/migrations/versions`` create exactly these tables; a test compares
the two, so a change here needs a new revision there.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Allowed values of the enum-like columns. Plain strings, not database enums: adding a value then needs
# no ALTER TYPE on PostgreSQL nor a table rebuild on SQLite; the repository validates them instead.
TRIGGERS = ("event", "schedule", "manual")
RUN_STATUSES = ("running", "succeeded", "failed", "skipped")
PLATFORMS = ("kubernetes", "local")
DEPLOYMENT_STATUSES = ("in_progress", "promoted", "rolled_back", "failed")
DECISIONS = ("pass", "fail", "inconclusive")
EVENT_SOURCES = ("sqs", "webhook")

# Deterministic constraint names: SQLite batch migrations and downgrades address constraints by name, and
# both backends must end up with the same names.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    SQLite has no timezone type and hands back naive values; PostgreSQL hands back the session's zone.
    Storing UTC and re-attaching it on the way out makes both return the same aware datetime.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            # A naive value is ambiguous (local time? UTC?); refusing it keeps lineage times trustworthy.
            raise ValueError(f"timestamp {value.isoformat()} has no timezone; pass an aware datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    versions: Mapped[list[DatasetVersion]] = relationship(back_populates="dataset")


class DatasetVersion(Base):
    __tablename__ = "dataset_versions"
    __table_args__ = (UniqueConstraint("dataset_id", "data_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id"))
    data_version: Mapped[str] = mapped_column(String(64), index=True)
    bucket: Mapped[str] = mapped_column(String(255))
    prefix: Mapped[str] = mapped_column(String(1024))
    manifest_key: Mapped[str] = mapped_column(String(1024))
    manifest_etag: Mapped[str] = mapped_column(String(255))
    manifest_version_id: Mapped[str | None] = mapped_column(String(1024))
    objects: Mapped[dict[str, dict[str, Any]]] = mapped_column(JSON)
    num_objects: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    dataset: Mapped[Dataset] = relationship(back_populates="versions")


class PipelineRun(Base):
    __tablename__ = "pipeline_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64), unique=True)
    trigger: Mapped[str] = mapped_column(String(16))
    trigger_event_id: Mapped[str | None] = mapped_column(String(64))
    dataset_version_id: Mapped[int | None] = mapped_column(ForeignKey("dataset_versions.id"), index=True)
    code_version: Mapped[str] = mapped_column(String(40))
    code_dirty: Mapped[bool] = mapped_column(Boolean)
    parameters: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    dataset_version: Mapped[DatasetVersion | None] = relationship()
    gate_results: Mapped[list[GateResult]] = relationship(back_populates="pipeline_run", order_by="GateResult.id")


class GateResult(Base):
    __tablename__ = "gate_results"
    __table_args__ = (UniqueConstraint("pipeline_run_id", "gate"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pipeline_run_id: Mapped[int] = mapped_column(ForeignKey("pipeline_runs.id"))
    gate: Mapped[str] = mapped_column(String(64))
    passed: Mapped[bool] = mapped_column(Boolean)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    report_uri: Mapped[str | None] = mapped_column(String(2048))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    pipeline_run: Mapped[PipelineRun] = relationship(back_populates="gate_results")


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_name: Mapped[str] = mapped_column(String(255))
    version: Mapped[str] = mapped_column(String(128))
    pipeline_run_id: Mapped[int | None] = mapped_column(ForeignKey("pipeline_runs.id"), index=True)
    dataset_version_id: Mapped[int | None] = mapped_column(ForeignKey("dataset_versions.id"))
    mlflow_run_id: Mapped[str] = mapped_column(String(64))
    mlflow_model_version: Mapped[str | None] = mapped_column(String(64))
    code_version: Mapped[str] = mapped_column(String(40))
    data_version: Mapped[str] = mapped_column(String(64), index=True)
    artifacts: Mapped[dict[str, str]] = mapped_column(JSON)
    environment: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    pipeline_run: Mapped[PipelineRun | None] = relationship()
    dataset_version: Mapped[DatasetVersion | None] = relationship()


class Deployment(Base):
    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"), index=True)
    platform: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    model_version: Mapped[ModelVersion] = relationship()
    steps: Mapped[list[RolloutStep]] = relationship(back_populates="deployment", order_by="RolloutStep.step_index")


class RolloutStep(Base):
    __tablename__ = "rollout_steps"
    __table_args__ = (UniqueConstraint("deployment_id", "step_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id"))
    step_index: Mapped[int] = mapped_column(Integer)
    canary_weight: Mapped[int] = mapped_column(Integer)
    stable_weight: Mapped[int] = mapped_column(Integer)
    observed: Mapped[dict[str, Any]] = mapped_column(JSON)
    decision: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    deployment: Mapped[Deployment] = relationship(back_populates="steps")


class AliasChange(Base):
    """One move of a registry alias (``champion``, ``challenger``): who moved it, from what, to what, why."""

    __tablename__ = "alias_changes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_name: Mapped[str] = mapped_column(String(255))
    alias: Mapped[str] = mapped_column(String(64))
    registry_version: Mapped[str | None] = mapped_column(String(64))  # None: the alias was removed
    model_version: Mapped[str | None] = mapped_column(String(128))
    previous_registry_version: Mapped[str | None] = mapped_column(String(64))
    previous_model_version: Mapped[str | None] = mapped_column(String(128))
    actor: Mapped[str] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(Text)
    pipeline_run_id: Mapped[int | None] = mapped_column(ForeignKey("pipeline_runs.id"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)


class S3Event(Base):
    __tablename__ = "s3_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dedupe_key: Mapped[str] = mapped_column(String(512), unique=True)
    event_id: Mapped[str] = mapped_column(String(36))
    source: Mapped[str] = mapped_column(String(16))
    bucket: Mapped[str] = mapped_column(String(255))
    key: Mapped[str] = mapped_column(String(1024), index=True)
    etag: Mapped[str] = mapped_column(String(255))
    version_id: Mapped[str | None] = mapped_column(String(1024))
    sequencer: Mapped[str | None] = mapped_column(String(64))
    size: Mapped[int | None] = mapped_column(BigInteger)
    event_time: Mapped[datetime | None] = mapped_column(UTCDateTime())
    received_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    emitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class DeadLetter(Base):
    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(Text)
    error: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
