"""A throwaway PostgreSQL cluster: ``initdb`` and ``pg_ctl`` in a temporary folder, a free loopback port,
all of it gone on exit. The tests give it to the metadata store, the event benchmark to the Prefect server
(as docker/compose.yaml runs it). Not for keeping data: fsync is off and any local user
may connect as the superuser over 127.0.0.1 (trust), so it lives only as long as its ``with`` block.

The server refuses to run as root (CI runs as root), so as root the cluster belongs to ``nobody`` and
its folders live under /tmp with mode 0755: pytest's and mkdtemp's usual folders are 0700, which
``nobody`` could not enter.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from sluicegate.errors import StackError

SERVER_USER = "nobody"
SUPERUSER = "postgres"
INSTALL_HINT = "install the server (`apt-get install postgresql`, or `make system-deps`)"


class PostgresUnavailable(StackError):
    """The PostgreSQL server binaries are missing, or the cluster did not start (the message says why)."""


@dataclass(frozen=True)
class PostgresCluster:
    host: str
    port: int
    data_dir: Path

    def url(self, database: str, driver: str = "psycopg") -> str:
        """A SQLAlchemy URL; ``driver="asyncpg"`` for Prefect's server."""
        return f"postgresql+{driver}://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        # CREATE/DROP DATABASE cannot run inside a transaction.
        return psycopg.connect(host=self.host, port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True)

    def create_database(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str) -> None:
        """Drops it even with connections still open (FORCE)."""
        with self.admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pg_binary(name: str) -> str:
    """``initdb``/``pg_ctl``: on PATH, else Debian's per-version folder (the newest major)."""
    found = shutil.which(name)
    if found:
        return found
    # Debian keeps the server binaries off PATH, one folder per major version.
    candidates = sorted(
        Path("/usr/lib/postgresql").glob(f"*/bin/{name}"),
        key=lambda path: int(path.parts[-3]) if path.parts[-3].isdigit() else 0,
    )
    if candidates:
        return str(candidates[-1])
    raise PostgresUnavailable(
        f"PostgreSQL's `{name}` was not found on PATH nor under /usr/lib/postgresql/*/bin; {INSTALL_HINT}"
    )


def _as_server_user(args: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", SERVER_USER, "--", *args]
    return args


def _run(args: list[str], cwd: Path) -> None:
    result = subprocess.run(_as_server_user(args), cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise PostgresUnavailable(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def _make_server_folder(path: Path) -> None:
    path.chmod(0o755)
    if os.geteuid() == 0:
        user = pwd.getpwnam(SERVER_USER)
        os.chown(path, user.pw_uid, user.pw_gid)


@contextmanager
def throwaway_cluster() -> Iterator[PostgresCluster]:
    """A started cluster on 127.0.0.1; stopped and deleted when the block ends, however it ends."""
    initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
    base = Path(tempfile.mkdtemp(prefix="sluicegate-pg-", dir="/tmp"))
    data_dir, sock_dir, log = base / "data", base / "sock", base / "server.log"
    sock_dir.mkdir()
    for path in (base, sock_dir):
        _make_server_folder(path)
    port = free_port()
    started = False
    try:
        _run([initdb, "-D", str(data_dir), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8"], base)
        # fsync off: a throwaway cluster needs no durability, and it makes CREATE DATABASE cheap.
        options = f"-p {port} -k {sock_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        try:
            _run([pg_ctl, "-D", str(data_dir), "-o", options, "-l", str(log), "-w", "start"], base)
        except PostgresUnavailable as exc:
            server_log = log.read_text() if log.exists() else "(no log)"
            raise PostgresUnavailable(f"PostgreSQL did not start on port {port}; server log:\n{server_log}") from exc
        started = True
        yield PostgresCluster("127.0.0.1", port, data_dir)
    finally:
        if started:
            _run([pg_ctl, "-D", str(data_dir), "-m", "fast", "-w", "stop"], base)
        shutil.rmtree(base, ignore_errors=True)
