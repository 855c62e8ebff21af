"""The detached supervisor process of the embedded stack (``sluicegate stack-supervise``): starts the
parts in phases, waits until each is healthy, restarts a part that dies (up to
``stack.max_restarts``) and, on SIGTERM, stops every part and every process those parts started
(flow runs included), recording each step in the state file."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from sluicegate import storage
from sluicegate.app.stack.processes import healthy, kill_tree, tail
from sluicegate.app.stack.services import SERVICES, Part, child_env, parts
from sluicegate.app.stack.state import FAILED, READY, STARTING, STOPPED, PartState, Paths, StackState
from sluicegate.errors import StackError
from sluicegate.settings import Settings

log = logging.getLogger(__name__)


class Supervisor:
    """Runs in the detached supervisor process: starts parts in order, keeps them alive."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.paths = Paths(settings.home)
        self.env = child_env(settings)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.state = StackState(status=STARTING, supervisor_pid=os.getpid(), parts={})
        self.stopping = False

    def write_state(self) -> None:
        tmp = self.paths.state.with_suffix(".tmp")
        tmp.write_text(self.state.to_json())
        tmp.replace(self.paths.state)

    def spawn(self, part: Part) -> None:
        log_path = self.paths.logs / f"{part.name}.log"
        handle = log_path.open("ab")
        proc = subprocess.Popen(
            part.argv,
            env={**self.env, **part.env},
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.settings.home,
            start_new_session=True,
        )
        handle.close()
        self.procs[part.name] = proc
        st = self.state.parts.setdefault(part.name, PartState(part.name, part.url, str(log_path)))
        st.pid, st.status = proc.pid, STARTING
        with contextlib.suppress(psutil.Error):
            st.created = psutil.Process(proc.pid).create_time()
        self.write_state()

    def wait_healthy(self, part: Part) -> None:
        deadline = time.monotonic() + self.settings.stack.start_timeout
        proc = self.procs[part.name]
        while time.monotonic() < deadline and not self.stopping:
            if proc.poll() is not None:
                raise StackError(f"{part.name} exited with code {proc.returncode} while starting")
            if healthy(part.health_url, verify=part.verify()):
                self.state.parts[part.name].status = READY
                self.write_state()
                return
            time.sleep(0.25)
        raise StackError(
            f"{part.name} did not become healthy at {part.health_url} within {self.settings.stack.start_timeout:.0f} s"
        )

    def start(self, before: dict[str, Callable[[], None]]) -> None:
        """Start the parts in phases: the services together, then their clients (bridge, runner).

        ``before[name]`` runs once the previous phase is healthy and before that part starts.
        """
        chosen = parts(self.settings)
        services = [part for part in chosen if part.name in SERVICES]
        clients = [part for part in chosen if part.name not in SERVICES]
        for phase in (services, clients):
            current: Part | None = None
            try:
                for part in phase:
                    current = part
                    if part.name in before:
                        before[part.name]()
                    self.spawn(part)
                for part in phase:
                    current = part
                    self.wait_healthy(part)
            except Exception as exc:
                assert current is not None
                self._record_failed_start(current, exc)
                raise
        self.state.status = READY
        self.write_state()

    def _record_failed_start(self, part: Part, exc: Exception) -> None:
        log_path = str(self.paths.logs / f"{part.name}.log")
        st = self.state.parts.setdefault(part.name, PartState(part.name, part.url, log_path))
        st.status, st.detail = FAILED, str(exc)
        self.state.status = FAILED
        self.state.error = f"{part.name} failed to start: {exc}\n--- last lines of {st.log} ---\n{tail(Path(st.log))}"
        self.write_state()

    def watch(self) -> None:
        table = {part.name: part for part in parts(self.settings)}
        while not self.stopping:
            for name, proc in list(self.procs.items()):
                if proc.poll() is None or self.stopping:
                    continue
                st = self.state.parts[name]
                if st.restarts >= self.settings.stack.max_restarts:
                    st.status, st.detail = FAILED, f"exited with code {proc.returncode}; restarts exhausted"
                    self.write_state()
                    continue
                st.restarts += 1
                log.warning("%s exited with code %s; restart %d", name, proc.returncode, st.restarts)
                kill_tree(proc.pid, 1)  # anything it left behind
                self.spawn(table[name])
                with contextlib.suppress(StackError):
                    self.wait_healthy(table[name])
            time.sleep(0.5)

    def stop(self) -> None:
        self.stopping = True
        for name in reversed(list(self.procs)):
            kill_tree(self.procs[name].pid, self.settings.stack.stop_timeout)
            self.state.parts[name].status = STOPPED
        self.state.status = STOPPED
        self.write_state()


def _provision(settings: Settings) -> Callable[[], None]:
    def run() -> None:
        storage.provision(settings)

    return run


def _upgrade_metadata(settings: Settings) -> Callable[[], None]:
    """Bring the metadata schema to this code's head before the bridge starts.

    This step creates or upgrades the schema, so it opens the store unchecked: ``MetadataStore.checked``
    would refuse the empty or outdated schema this step exists to fix.
    """

    def run() -> None:
        from sluicegate.metadata import MetadataStore

        with MetadataStore.unchecked(settings.metadata_url) as store:
            store.upgrade()

    return run


def _chain(*steps: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for step in steps:
            step()

    return run


def supervise(settings: Settings) -> int:
    """Entry of the detached supervisor process."""
    paths = Paths(settings.home)
    paths.make()
    lock = paths.lock.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.error("another supervisor holds %s", paths.lock)
        return 1
    supervisor = Supervisor(settings)

    def on_signal(signum: int, _frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The bridge is the first consumer of the queue and the store: both are ready before it starts.
    steps = [_upgrade_metadata(settings)]
    if settings.storage.embedded:
        steps.insert(0, _provision(settings))
    hooks: dict[str, Callable[[], None]] = {"bridge": _chain(*steps)}
    code = 0
    try:
        supervisor.start(hooks)
        supervisor.watch()
    except Exception as exc:
        log.error("stack failed: %s", exc)
        code = 1
    finally:
        failed = supervisor.state.status == FAILED
        error = supervisor.state.error
        supervisor.stop()
        if failed:
            supervisor.state.status, supervisor.state.error = FAILED, error
            supervisor.write_state()
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    return code
