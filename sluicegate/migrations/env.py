"""Alembic environment of the metadata store.

``MetadataStore`` configures Alembic in code and hands over its own connection in
``config.attributes["connection"]``, so migrations run on exactly the engine (URL, SQLite pragmas) the
application uses. Without one (a developer running ``alembic -c some.ini revision --autogenerate``),
the ``sqlalchemy.url`` option of that config is used instead.
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlalchemy import Connection, create_engine

from sluicegate.metadata.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # A revision must not import application types (they change; revisions must not): write the UTC
    # wrapper as the column type it stores.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection: Connection | None = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError(
            "no connection for the migrations: run them through `sluicegate db upgrade`, "
            "or set sqlalchemy.url in the Alembic config"
        )
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
