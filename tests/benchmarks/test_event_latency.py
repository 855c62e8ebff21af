"""The event benchmark's count of Prefect's retryable database errors, read from the server's log."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from benchmarks.event_latency import BODY, DATABASE_URL, prefect_database, retryable_errors, summarise

# Shaped like Prefect 3.9.1's server log with PREFECT_API_LOG_RETRYABLE_ERRORS=true (2026-12-07).
LOG = """\
16:33:41.002 | INFO    | prefect.server.events.triggers - Automation dataset-pipeline__automation_1 fired
16:33:50.683 | ERROR   | prefect.server - Encountered retryable exception in request:
Traceback (most recent call last):
sqlite3.OperationalError: database is locked
sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked
[SQL: INSERT INTO flow_run (flow_id, deployment_id, work_queue_name) VALUES (:flow_id, :deployment_id, :w)]
16:34:02.114 | ERROR   | prefect.server - Encountered retryable exception in request:
Traceback (most recent call last):
sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked
[SQL: UPDATE deployment SET last_polled=:last_polled WHERE deployment.id IN (__[POSTCOMPILE_id_1])]
"""


def test_retryable_errors_are_counted_and_those_creating_a_flow_run_told_apart(tmp_path: Path) -> None:
    log = tmp_path / "prefect.log"
    log.write_text(LOG)

    assert retryable_errors(log) == {"all": 2, "creating a flow run": 1}


def test_no_log_or_no_error_counts_nothing(tmp_path: Path) -> None:
    assert retryable_errors(tmp_path / "missing.log") == {"all": 0, "creating a flow run": 0}
    quiet = tmp_path / "prefect.log"
    quiet.write_text(LOG.split("16:33:50")[0])
    assert retryable_errors(quiet) == {"all": 0, "creating a flow run": 0}


def test_the_postgresql_run_gets_a_live_database_and_the_inherited_url_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DATABASE_URL, "postgresql+asyncpg://someone@elsewhere/theirs")

    with prefect_database("postgresql"):
        url = make_url(os.environ[DATABASE_URL])
        assert url.drivername == "postgresql+asyncpg"  # Prefect's server needs the async driver
        with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname=url.database) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("prefect",)

    assert os.environ[DATABASE_URL] == "postgresql+asyncpg://someone@elsewhere/theirs"
    with pytest.raises(psycopg.OperationalError):  # the throwaway cluster is gone
        psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres", connect_timeout=3)


def test_the_sqlite_run_leaves_the_server_on_its_default_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATABASE_URL, "postgresql+asyncpg://someone@elsewhere/theirs")

    with prefect_database("sqlite"):
        assert DATABASE_URL not in os.environ

    assert os.environ[DATABASE_URL] == "postgresql+asyncpg://someone@elsewhere/theirs"


def test_the_verdict_needs_both_percentiles_within_the_target() -> None:
    fast = [{"PUT -> run created": 0.1, BODY: 0.5} for _ in range(19)]
    one_slow = summarise([*fast, {"PUT -> run created": 2.1, BODY: 2.5}])
    two_slow = summarise([*fast[:18], *[{"PUT -> run created": 2.1, BODY: 2.5}] * 2])

    assert one_slow[BODY]["verdict"] == "PASS"  # p95 of 20 interpolates between the 19th and the 20th
    assert two_slow[BODY]["verdict"] == "MISS"
    assert two_slow[BODY]["p50"] == pytest.approx(0.5)
    assert two_slow["PUT -> run created"]["verdict"] == "-"  # no target on the inner hops


def test_errors_before_the_offset_are_not_counted(tmp_path: Path) -> None:
    log = tmp_path / "prefect.log"
    log.write_text(LOG)
    second_error = LOG.encode().index(b"16:34:02")

    assert retryable_errors(log, after=second_error) == {"all": 1, "creating a flow run": 0}
    assert retryable_errors(log, after=len(LOG.encode())) == {"all": 0, "creating a flow run": 0}
