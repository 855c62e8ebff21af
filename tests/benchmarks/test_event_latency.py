"""The event benchmark's count of Prefect's retryable database errors, read from the server's log."""

from __future__ import annotations

from pathlib import Path

from benchmarks.event_latency import sqlite_retries

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

    assert sqlite_retries(log) == {"all": 2, "creating a flow run": 1}


def test_no_log_or_no_error_counts_nothing(tmp_path: Path) -> None:
    assert sqlite_retries(tmp_path / "missing.log") == {"all": 0, "creating a flow run": 0}
    quiet = tmp_path / "prefect.log"
    quiet.write_text(LOG.split("16:33:50")[0])
    assert sqlite_retries(quiet) == {"all": 0, "creating a flow run": 0}
