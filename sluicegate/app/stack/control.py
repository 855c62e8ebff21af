"""Controlling the embedded stack from outside it: ``up`` spawns the detached supervisor and waits
until every part is healthy (or finds it running), ``status`` probes each part now, ``down`` stops the
supervisor and anything that outlived it, ``running`` wraps a block in ``up``/``down``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sluicegate.app.stack.processes import healthy, kill_tree, process_running, tail
from sluicegate.app.stack.services import child_env, parts
from sluicegate.app.stack.state import FAILED, READY, STOPPED, Paths, StackState, read_state, supervisor_alive
from sluicegate.errors import StackError
from sluicegate.settings import Settings


def up(settings: Settings, on_progress: Callable[[StackState], None] | None = None) -> tuple[StackState, bool]:
    """Start the stack (or find it running); returns its state and whether it was started now.

    Raises:
        StackError: a part failed to start; the message names it with its log's last lines.
    """
    paths = Paths(settings.home)
    paths.make()
    if supervisor_alive(paths):
        state = read_state(paths)
        if state is not None and state.status == READY:
            return state, False
        wait = _wait_ready(paths, settings, on_progress)
        return wait, False
    with contextlib.suppress(FileNotFoundError):
        paths.state.unlink()
    with paths.supervisor_log.open("ab") as handle:
        subprocess.Popen(
            [sys.executable, "-m", "sluicegate.app.cli", "stack-supervise"],
            env=child_env(settings),
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=settings.home,
            start_new_session=True,
        )
    return _wait_ready(paths, settings, on_progress), True


def _wait_ready(paths: Paths, settings: Settings, on_progress: Callable[[StackState], None] | None) -> StackState:
    budget = settings.stack.start_timeout * 5 + 30
    deadline = time.monotonic() + budget
    started = time.monotonic()
    while time.monotonic() < deadline:
        state = read_state(paths)
        if state is not None:
            if on_progress:
                on_progress(state)
            if state.status == READY:
                return state
            if state.status in (FAILED, STOPPED):
                raise StackError(state.error or "the stack stopped while starting; see " + str(paths.supervisor_log))
        if time.monotonic() - started > 5 and not supervisor_alive(paths):
            raise StackError("the supervisor exited while starting:\n" + tail(paths.supervisor_log))
        time.sleep(0.3)
    raise StackError(f"the stack was not ready within {budget:.0f} s; see {paths.logs}")


@dataclass(frozen=True)
class PartHealth:
    name: str
    url: str
    pid: int | None
    running: bool
    healthy: bool
    restarts: int
    log: str


def status(settings: Settings) -> tuple[str, list[PartHealth]]:
    """Each part's process and health as seen now (not as last recorded)."""
    paths = Paths(settings.home)
    state = read_state(paths)
    alive = supervisor_alive(paths)
    if state is None:
        return ("stopped", [])
    by_name = {part.name: part for part in parts(settings)}
    rows = []
    for name, st in state.parts.items():
        running = alive and st.pid is not None and process_running(st.pid, st.created)
        ok = running and name in by_name and healthy(by_name[name].health_url, verify=by_name[name].verify())
        rows.append(PartHealth(name, st.url, st.pid, running, ok, st.restarts, st.log))
    overall = "stopped" if not alive else state.status if all(r.healthy for r in rows) else "degraded"
    return overall, rows


def down(settings: Settings) -> list[int]:
    """Stop the supervisor and every part; returns pids that had to be killed directly."""
    paths = Paths(settings.home)
    state = read_state(paths)
    killed: list[int] = []
    if state is not None and supervisor_alive(paths):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + settings.stack.stop_timeout * (len(state.parts) + 1)
        while supervisor_alive(paths) and time.monotonic() < deadline:
            time.sleep(0.2)
        if supervisor_alive(paths):
            kill_tree(state.supervisor_pid, 1)
            killed.append(state.supervisor_pid)
        # The lock is released just before the supervisor exits: wait for the exit itself.
        while process_running(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    # Whatever outlived the supervisor (it was SIGKILLed, or crashed) is stopped here.
    for st in state.parts.values() if state else []:
        if st.pid is not None and process_running(st.pid, st.created):
            kill_tree(st.pid, settings.stack.stop_timeout)
            killed.append(st.pid)
    return killed


@contextlib.contextmanager
def running(settings: Settings) -> Iterator[StackState]:
    """The stack for the duration of a block (tests, benchmarks, the demo)."""
    state, _ = up(settings)
    try:
        yield state
    finally:
        down(settings)


def describe(state: StackState) -> dict[str, Any]:
    return {name: {"url": st.url, "pid": st.pid, "status": st.status} for name, st in state.parts.items()}
