"""Initial schema: datasets, pipeline runs, gate results, model versions, deployments, S3 events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Constraint names are spelled out (they follow the models' naming convention) so that PostgreSQL and
SQLite get the same names and later revisions can address them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _id(table: str) -> tuple[sa.Column[Any], sa.PrimaryKeyConstraint]:
    return sa.Column("id", sa.Integer(), nullable=False), sa.PrimaryKeyConstraint("id", name=f"pk_{table}")


def _fk(table: str, column: str, referred: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint([column], [f"{referred}.id"], name=f"fk_{table}_{column}_{referred}")


def upgrade() -> None:
    op.create_table(
        "datasets",
        *_id("datasets"),
        sa.Column("name", sa.String(255), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("name", name="uq_datasets_name"),
    )
    op.create_table(
        "dataset_versions",
        *_id("dataset_versions"),
        sa.Column("dataset_id", sa.Integer(), nullable=False),
        sa.Column("data_version", sa.String(64), nullable=False),
        sa.Column("bucket", sa.String(255), nullable=False),
        sa.Column("prefix", sa.String(1024), nullable=False),
        sa.Column("manifest_key", sa.String(1024), nullable=False),
        sa.Column("manifest_etag", sa.String(255), nullable=False),
        sa.Column("manifest_version_id", sa.String(1024), nullable=True),
        sa.Column("objects", sa.JSON(), nullable=False),
        sa.Column("num_objects", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        _fk("dataset_versions", "dataset_id", "datasets"),
        sa.UniqueConstraint("dataset_id", "data_version", name="uq_dataset_versions_dataset_id_data_version"),
    )
    op.create_index("ix_dataset_versions_data_version", "dataset_versions", ["data_version"])
    op.create_table(
        "pipeline_runs",
        *_id("pipeline_runs"),
        sa.Column("prefect_flow_run_id", sa.String(64), nullable=True),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("trigger_event_id", sa.String(64), nullable=True),
        sa.Column("dataset_version_id", sa.Integer(), nullable=True),
        sa.Column("code_version", sa.String(40), nullable=False),
        sa.Column("code_dirty", sa.Boolean(), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        _timestamp("started_at"),
        _timestamp("finished_at", nullable=True),
        _fk("pipeline_runs", "dataset_version_id", "dataset_versions"),
        sa.UniqueConstraint("prefect_flow_run_id", name="uq_pipeline_runs_prefect_flow_run_id"),
    )
    op.create_index("ix_pipeline_runs_dataset_version_id", "pipeline_runs", ["dataset_version_id"])
    op.create_table(
        "gate_results",
        *_id("gate_results"),
        sa.Column("pipeline_run_id", sa.Integer(), nullable=False),
        sa.Column("gate", sa.String(64), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("report_uri", sa.String(2048), nullable=True),
        _timestamp("created_at"),
        _fk("gate_results", "pipeline_run_id", "pipeline_runs"),
        sa.UniqueConstraint("pipeline_run_id", "gate", name="uq_gate_results_pipeline_run_id_gate"),
    )
    op.create_table(
        "model_versions",
        *_id("model_versions"),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("pipeline_run_id", sa.Integer(), nullable=True),
        sa.Column("dataset_version_id", sa.Integer(), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=False),
        sa.Column("mlflow_model_version", sa.String(64), nullable=True),
        sa.Column("code_version", sa.String(40), nullable=False),
        sa.Column("data_version", sa.String(64), nullable=False),
        sa.Column("artifacts", sa.JSON(), nullable=False),
        sa.Column("environment", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        _fk("model_versions", "pipeline_run_id", "pipeline_runs"),
        _fk("model_versions", "dataset_version_id", "dataset_versions"),
        sa.UniqueConstraint("model_name", "version", name="uq_model_versions_model_name_version"),
    )
    op.create_index("ix_model_versions_data_version", "model_versions", ["data_version"])
    op.create_index("ix_model_versions_pipeline_run_id", "model_versions", ["pipeline_run_id"])
    op.create_table(
        "deployments",
        *_id("deployments"),
        sa.Column("model_version_id", sa.Integer(), nullable=False),
        sa.Column("platform", sa.String(16), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        _timestamp("started_at"),
        _timestamp("finished_at", nullable=True),
        _fk("deployments", "model_version_id", "model_versions"),
    )
    op.create_index("ix_deployments_model_version_id", "deployments", ["model_version_id"])
    op.create_table(
        "rollout_steps",
        *_id("rollout_steps"),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("canary_weight", sa.Integer(), nullable=False),
        sa.Column("stable_weight", sa.Integer(), nullable=False),
        sa.Column("observed", sa.JSON(), nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        _timestamp("created_at"),
        _fk("rollout_steps", "deployment_id", "deployments"),
        sa.UniqueConstraint("deployment_id", "step_index", name="uq_rollout_steps_deployment_id_step_index"),
    )
    op.create_table(
        "s3_events",
        *_id("s3_events"),
        sa.Column("dedupe_key", sa.String(512), nullable=False),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("bucket", sa.String(255), nullable=False),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("etag", sa.String(255), nullable=False),
        sa.Column("version_id", sa.String(1024), nullable=True),
        sa.Column("sequencer", sa.String(64), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        _timestamp("event_time", nullable=True),
        _timestamp("received_at"),
        _timestamp("emitted_at", nullable=True),
        sa.UniqueConstraint("dedupe_key", name="uq_s3_events_dedupe_key"),
    )
    op.create_index("ix_s3_events_key", "s3_events", ["key"])
    op.create_table(
        "dead_letters",
        *_id("dead_letters"),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        _timestamp("received_at"),
    )


def downgrade() -> None:
    # Children before parents; dropping a table drops its indexes on both backends.
    for table in (
        "dead_letters",
        "s3_events",
        "rollout_steps",
        "deployments",
        "model_versions",
        "gate_results",
        "pipeline_runs",
        "dataset_versions",
        "datasets",
    ):
        op.drop_table(table)
