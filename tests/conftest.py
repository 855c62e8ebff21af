import os

# No telemetry from any library under test (there is no network here either).
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

pytest_plugins = ["tests.fixtures.postgres", "tests.fixtures.services", "tests.fixtures.platform"]
