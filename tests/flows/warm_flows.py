"""Test-only flows that tests/flows/test_warm_runner.py runs through the warm runner."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from prefect import flow, get_run_logger

# Module state: a run that could see another run's module would count more than one call.
CALLS: list[str] = []


@flow(name="warm-probe")
def probe(out: str) -> None:
    """Writes where it ran (pid, parent) and how many calls its module has seen to ``out``."""
    CALLS.append(out)
    get_run_logger().info("probe running in process %d", os.getpid())
    report = {"pid": os.getpid(), "ppid": os.getppid(), "calls": len(CALLS)}
    Path(out).write_text(json.dumps(report))


@flow(name="warm-crash")
def crash(how: str) -> None:
    """Dies without a word to Prefect: ``exit`` (os._exit) or ``kill`` (SIGKILL on itself)."""
    if how == "exit":
        os._exit(13)
    os.kill(os.getpid(), signal.SIGKILL)


@flow(name="warm-wait")
def wait_for(path: str, started: str) -> None:
    """Announces itself in ``started``, then blocks until ``path`` exists (the test's go-ahead)."""
    Path(started).write_text(str(os.getpid()))
    while not Path(path).exists():
        time.sleep(0.05)
