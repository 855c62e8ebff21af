import os

import pytest

# No telemetry from any library under test (there is no network here either).
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
# Test servers stop at once; tests/serving/test_shutdown.py sets its own delay to check the real one.
os.environ.setdefault("SLUICEGATE_SERVING__SHUTDOWN_DELAY_S", "0")
# One server process unless a test asks for workers (tests/serving/test_workers.py): auto would start a
# supervisor and one worker per core.
os.environ.setdefault("SLUICEGATE_SERVING__WORKERS", "1")

# The kmock cluster module asserts in its readers: pytest explains those failures as it does the tests'.
# Registered here, at the root: tests/infra imports it too, before tests/tasks/conftest.py would run.
pytest.register_assert_rewrite("tests.tasks.kmock_cluster")

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.services", "tests.fixtures.platform"]
