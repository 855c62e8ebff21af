"""The metadata store: one engine, managed sessions, the schema's Alembic revision, and how a store is opened."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from serving.redact import mask_url
from sluicegate.errors import SchemaOutdated, StoreUnavailable

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

# The event bridge and flow runs write to one SQLite file from several processes; a writer waits this
# long for the lock instead of failing at once with "database is locked".
SQLITE_BUSY_TIMEOUT_S = 30.0

# A PostgreSQL host that drops packets (rather than refusing) would hold a connect for the OS's TCP
# timeout, minutes; this bounds each attempt (a `connect_timeout` in the URL wins), and the pipeline's
# stage retries cover a longer outage.
POSTGRES_CONNECT_TIMEOUT_S = 10

_UPGRADE_HINT = "run `sluicegate db upgrade`"

# PostgreSQL SQLSTATEs of a missing table/column: the schema was never created or is behind the code.
_PG_UNDEFINED = {"42P01", "42703"}
_SQLITE_UNDEFINED = ("no such table", "no such column")


class MetadataStore:
    """Lineage records in PostgreSQL or SQLite, behind one SQLAlchemy engine.

    Args:
        url: SQLAlchemy URL, e.g. ``postgresql+psycopg://user:pw@host/db`` or ``sqlite:////abs/path.db``.
    """

    def __init__(self, url: str) -> None:
        self._url = make_url(url)
        kwargs: dict[str, Any] = {"future": True, "pool_pre_ping": True, "json_serializer": dumps_json}
        if self._url.get_backend_name() == "sqlite":
            self._prepare_sqlite_file()
            kwargs["connect_args"] = {"timeout": SQLITE_BUSY_TIMEOUT_S}
        elif self._url.get_backend_name() == "postgresql" and "connect_timeout" not in self._url.query:
            kwargs["connect_args"] = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S}
        self._engine = create_engine(self._url, **kwargs)
        if self._url.get_backend_name() == "sqlite":
            event.listen(self._engine, "connect", _sqlite_on_connect)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    @property
    def url_redacted(self) -> str:
        """The URL with its password masked, safe for logs and error messages."""
        # The one masking helper (serving/redact.py), not sqlalchemy's: one rule for every URL we print.
        return mask_url(self._url.render_as_string(hide_password=False))

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block ends and rolls back if it raises.

        Rows returned from it stay usable after the block (no expiry on commit); relationships not
        loaded inside the block cannot be loaded after it.

        Raises:
            StoreUnavailable: the database cannot be reached (or, for SQLite, opened or locked).
            SchemaOutdated: a table or column the code needs does not exist.
        """
        with self._translate_errors(), self._sessions.begin() as session:
            yield session

    def upgrade(self, revision: str = "head") -> None:
        """Migrate the schema up to ``revision`` (default: the newest this code knows)."""
        with self._translate_errors(), self._engine.begin() as conn:
            log.info("upgrading metadata store at %s to %s", self.url_redacted, revision)
            command.upgrade(self._alembic_config(conn), revision)

    def downgrade(self, revision: str) -> None:
        """Migrate the schema down to ``revision`` (``base`` drops every table)."""
        with self._translate_errors(), self._engine.begin() as conn:
            log.info("downgrading metadata store at %s to %s", self.url_redacted, revision)
            command.downgrade(self._alembic_config(conn), revision)

    def current_revision(self) -> str | None:
        """The revision the database is at; None when it was never migrated."""
        with self._translate_errors(), self._engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def head_revision(self) -> str:
        """The newest revision shipped with this code."""
        head = self._script_directory().get_current_head()
        if head is None:  # only if the versions folder was not packaged
            raise SchemaOutdated(f"no migrations found under {MIGRATIONS_DIR}; reinstall sluicegate")
        return head

    def check_schema(self) -> None:
        """Refuse to work on a schema other than the one this code was written for.

        Raises:
            SchemaOutdated: the database is un-migrated, behind, or ahead of this code; the message says
                which command fixes it.
            StoreUnavailable: the database cannot be reached.
        """
        current, head = self.current_revision(), self.head_revision()
        if current == head:
            return
        where = f"metadata store at {self.url_redacted}"
        if current is None:
            raise SchemaOutdated(f"{where} has no sluicegate schema (expected revision {head}); {_UPGRADE_HINT}")
        if not self._knows_revision(current):
            raise SchemaOutdated(
                f"{where} is at revision {current}, newer than this sluicegate (expects {head}): "
                "the database was migrated by a newer release; upgrade sluicegate"
            )
        raise SchemaOutdated(f"{where} is at revision {current}, expected {head}; {_UPGRADE_HINT}")

    def dispose(self) -> None:
        """Close every pooled connection (call before the process exits or the database is dropped)."""
        self._engine.dispose()

    @classmethod
    @contextmanager
    def checked(cls, url: str) -> Iterator[MetadataStore]:
        """A store on ``url`` whose schema is current (``check_schema``), disposed on the way out.

        The one way to open a store for reading and writing rows, for a command or for a service's
        lifetime.

        Raises:
            StoreUnavailable: the database cannot be reached.
            SchemaOutdated: its schema is not this code's; the message names the upgrade command.
        """
        with cls.unchecked(url) as store:
            store.check_schema()
            yield store

    @classmethod
    @contextmanager
    def unchecked(cls, url: str) -> Iterator[MetadataStore]:
        """A store on ``url`` whatever its schema, disposed on the way out: only for what brings a schema up
        to date (``sluicegate db upgrade|downgrade|current``, the embedded stack's start)."""
        store = cls(url)
        try:
            yield store
        finally:
            store.dispose()

    def _alembic_config(self, connection: Connection | None = None) -> Config:
        config = Config()
        # Options go through configparser interpolation, where a literal % must be doubled.
        config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
        if connection is not None:
            config.attributes["connection"] = connection
        return config

    def _script_directory(self) -> ScriptDirectory:
        return ScriptDirectory.from_config(self._alembic_config())

    def _knows_revision(self, revision: str) -> bool:
        try:
            return self._script_directory().get_revision(revision) is not None
        except CommandError:
            return False

    def _prepare_sqlite_file(self) -> None:
        database = self._url.database
        if not database or database == ":memory:" or database.startswith("file:"):
            return
        try:
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(
                f"metadata store at {self.url_redacted} cannot be created: {exc}; "
                "check SLUICEGATE_METADATA__URL or the permissions of its directory"
            ) from exc

    @contextmanager
    def _translate_errors(self) -> Iterator[None]:
        try:
            yield
        except (OperationalError, InterfaceError, DisconnectionError) as exc:
            detail = self._detail(exc)
            if self._is_missing_schema(exc):
                raise SchemaOutdated(
                    f"metadata store at {self.url_redacted} lacks part of the schema ({detail}); {_UPGRADE_HINT}"
                ) from exc
            raise StoreUnavailable(
                f"metadata store at {self.url_redacted} is unreachable: {detail}; {self._reach_hint()}"
            ) from exc
        except DBAPIError as exc:
            if not self._is_missing_schema(exc):
                raise
            raise SchemaOutdated(
                f"metadata store at {self.url_redacted} lacks part of the schema ({self._detail(exc)}); {_UPGRADE_HINT}"
            ) from exc

    def _reach_hint(self) -> str:
        if self.dialect == "sqlite":
            return "check SLUICEGATE_METADATA__URL and that the file can be opened and is not locked by another writer"
        server = "PostgreSQL" if self.dialect == "postgresql" else "the database server"
        return f"is {server} running and accepting connections there? check SLUICEGATE_METADATA__URL"

    def _detail(self, exc: Exception) -> str:
        # The driver's own message, without SQLAlchemy's SQL echo and background link; a password the
        # driver might quote is masked like the URL's.
        orig = getattr(exc, "orig", None) or exc
        text = " ".join(str(orig).split())
        if self._url.password:
            text = text.replace(str(self._url.password), "***")
        return text

    def _is_missing_schema(self, exc: Exception) -> bool:
        orig = getattr(exc, "orig", None)
        if getattr(orig, "sqlstate", None) in _PG_UNDEFINED:
            return True
        return self.dialect == "sqlite" and str(orig).startswith(_SQLITE_UNDEFINED)


def dumps_json(value: Any) -> str:
    """JSON for the store's JSON columns, with NaN and infinities written as strings.

    A diverged training run reports a NaN loss, and the gate that caught it must still be recorded.
    PostgreSQL rejects the non-standard ``NaN`` token that ``json.dumps`` writes while SQLite keeps it;
    strings ("NaN", "Infinity", "-Infinity") read back the same from both.
    """
    return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # SQLite ignores foreign keys unless asked, per connection; WAL lets readers run beside the writer.
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()
