"""Alias changes: every move of a registry alias with who, why and from what.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alias_changes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("alias", sa.String(64), nullable=False),
        sa.Column("registry_version", sa.String(64), nullable=True),
        sa.Column("model_version", sa.String(128), nullable=True),
        sa.Column("previous_registry_version", sa.String(64), nullable=True),
        sa.Column("previous_model_version", sa.String(128), nullable=True),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("pipeline_run_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_alias_changes"),
        sa.ForeignKeyConstraint(
            ["pipeline_run_id"], ["pipeline_runs.id"], name="fk_alias_changes_pipeline_run_id_pipeline_runs"
        ),
    )
    op.create_index("ix_alias_changes_created_at", "alias_changes", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_alias_changes_created_at", table_name="alias_changes")
    op.drop_table("alias_changes")
