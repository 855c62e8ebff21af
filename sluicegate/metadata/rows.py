"""What every repository module shares: an idempotent insert, a row by id or a clear error, and field checks.

The checks raise ``ValueError`` with the field, the value and what is allowed; a missing row raises
``LookupError`` naming the table's row and id. The caller's session commits or rolls back.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from sluicegate.errors import ConfigError
from sluicegate.metadata.models import Base

ModelT = TypeVar("ModelT", bound=Base)

HEX = re.compile(r"[0-9a-f]+")


def insert_ignore(session: Session, model: type[Base], values: Mapping[str, Any], conflict: tuple[str, ...]) -> bool:
    """``INSERT ... ON CONFLICT DO NOTHING`` on the unique columns ``conflict``.

    Two processes inserting the same natural key at once both succeed and one row remains.

    Returns:
        True when this call inserted the row, False when it existed already.

    Raises:
        ConfigError: the store is neither PostgreSQL nor SQLite.
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        pg = postgresql.insert(model).values(**values).on_conflict_do_nothing(index_elements=conflict)
        stmt = pg.returning(pg.table.c.id)
    elif dialect == "sqlite":
        lite = sqlite.insert(model).values(**values).on_conflict_do_nothing(index_elements=conflict)
        stmt = lite.returning(lite.table.c.id)
    else:
        raise ConfigError(
            f"the metadata store supports postgresql and sqlite, not {dialect}; "
            "set SLUICEGATE_METADATA__URL to a postgresql+psycopg:// or sqlite:/// URL"
        )
    return session.execute(stmt).first() is not None


def require(session: Session, model: type[ModelT], row_id: int, what: str) -> ModelT:
    """The row of ``model`` with primary key ``row_id``.

    Raises:
        LookupError: there is none; the message calls it ``what`` (e.g. "pipeline run").
    """
    row = session.get(model, row_id)
    if row is None:
        raise LookupError(f"{what} {row_id} does not exist in the metadata store")
    return row


def check_choice(field: str, value: str, allowed: Collection[str]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed`` (the enum-like columns)."""
    if value not in allowed:
        choices = ", ".join(repr(choice) for choice in allowed)
        raise ValueError(f"{field} must be one of {choices}, got {value!r}")


def check_hex(field: str, value: str, length: int) -> None:
    """Raise ``ValueError`` unless ``value`` is ``length`` lowercase hex characters (e.g. a sha256)."""
    if len(value) != length or not HEX.fullmatch(value):
        raise ValueError(f"{field} must be {length} lowercase hex characters, got {value!r}")


def check_code_version(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a 40-hex git commit or ``"unknown"``."""
    if value != "unknown" and (len(value) != 40 or not HEX.fullmatch(value)):
        raise ValueError(f"code_version must be a 40-hex git commit or 'unknown', got {value!r}")


def check_aware(field: str, value: datetime | None) -> None:
    """Raise ``ValueError`` when ``value`` is a naive datetime (None passes)."""
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{field} must be timezone-aware (UTC), got naive {value.isoformat()}")
