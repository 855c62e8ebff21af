"""The embedded stack: S3+SQS (moto), Prefect server, MLflow server, the local model server, the event
bridge and a runner, as supervised child processes of one detached supervisor.

``up`` starts the supervisor and waits until every part is healthy; the supervisor restarts a part
that dies (up to ``stack.max_restarts``) and, on SIGTERM, stops every part and every process those
parts started (flow runs included). State lives under ``<home>/run``; logs under ``<home>/logs``.
A part whose service is configured externally (a URL setting) is not started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from sluicegate import storage
from sluicegate.errors import StackError
from sluicegate.settings import LOOPBACK, Settings

log = logging.getLogger(__name__)

READY = "ready"
STARTING = "starting"
FAILED = "failed"
STOPPED = "stopped"
# Started together first; the bridge and the runner are their clients and start after them.
SERVICES = ("s3", "prefect", "mlflow", "serving")


@dataclass(frozen=True)
class Part:
    """One child process of the stack."""

    name: str
    argv: list[str]
    health_url: str
    url: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class PartState:
    name: str
    url: str
    log: str
    pid: int | None = None
    # With the pid, identifies the process: a stale state file must not make `down` kill a
    # process that reused the pid.
    created: float | None = None
    status: str = STARTING
    restarts: int = 0
    detail: str = ""


@dataclass
class StackState:
    status: str
    supervisor_pid: int
    parts: dict[str, PartState]
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StackState:
        raw = json.loads(text)
        parts = {name: PartState(**part) for name, part in raw["parts"].items()}
        return cls(status=raw["status"], supervisor_pid=raw["supervisor_pid"], parts=parts, error=raw.get("error", ""))


class Paths:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.run = home / "run"
        self.logs = home / "logs"
        self.state = self.run / "state.json"
        self.lock = self.run / "supervisor.lock"
        self.supervisor_log = self.logs / "supervisor.log"

    def make(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)


def _bin(name: str) -> str:
    """A console script of this environment (the venv's), falling back to PATH."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def child_env(settings: Settings) -> dict[str, str]:
    """Environment every part and every flow run shares: where each service is, no telemetry."""
    # The settings object is the truth: inherited SLUICEGATE_* variables could contradict it.
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLUICEGATE_")}
    env.update(settings.to_env())
    env.update(storage.credentials_env(settings))
    if settings.stack.serving and settings.rollout.admin_token is None:
        # Flow runs move the local server's traffic with the token the stack gave it.
        env["SLUICEGATE_ROLLOUT__ADMIN_TOKEN"] = local_admin_token(settings)
    env.update(
        {
            "PREFECT_API_URL": settings.prefect.url,
            "PREFECT_HOME": str(settings.home / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "MLFLOW_TRACKING_URI": settings.mlflow.url,
            "GX_ANALYTICS_ENABLED": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def parts(settings: Settings) -> list[Part]:
    """The parts to start, in start order; external services are left out."""
    py = sys.executable
    chosen: list[Part] = []
    if settings.storage.embedded:
        url = settings.storage.url
        chosen.append(
            Part(
                "s3",
                [py, "-m", "moto.server", "-H", LOOPBACK, "-p", str(settings.storage.port)],
                f"{url}/moto-api/data.json",
                url,
            )
        )
    if settings.prefect.embedded:
        argv = [_bin("prefect"), "server", "start", "--host", LOOPBACK, "--port", str(settings.prefect.port)]
        if not settings.prefect.ui:
            argv.append("--no-ui")
        chosen.append(
            Part("prefect", argv, f"{settings.prefect.url}/health", settings.prefect.url.removesuffix("/api"))
        )
    if settings.mlflow.embedded:
        artifacts = f"s3://{settings.storage.bucket}/{settings.mlflow.artifacts_prefix.strip('/')}"
        argv = [
            _bin("mlflow"),
            "server",
            "--host",
            LOOPBACK,
            "--port",
            str(settings.mlflow.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{settings.home / 'mlflow.db'}",
            "--artifacts-destination",
            artifacts,
        ]
        # One worker and no job runner: the default server starts 16 processes (~3 GB) (FACTS.md).
        chosen.append(
            Part(
                "mlflow",
                argv,
                f"{settings.mlflow.url}/health",
                settings.mlflow.url,
                {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            )
        )
    if settings.stack.serving:
        chosen.append(_serving_part(settings))
    chosen.append(
        Part(
            "bridge",
            [py, "-m", "sluicegate.app.cli", "bridge"],
            f"http://{LOOPBACK}:{settings.events.webhook_port}/health",
            f"http://{LOOPBACK}:{settings.events.webhook_port}/events",
        )
    )
    chosen.append(
        Part(
            "runner",
            [py, "-m", "flows.deployments"],
            f"http://{LOOPBACK}:{settings.prefect.runner_port}/health",
            "dataset-pipeline, scheduled-retrain",
            {
                "PREFECT_RUNNER_POLL_FREQUENCY": str(settings.prefect.runner_poll_seconds),
                "PREFECT_RUNNER_SERVER_ENABLE": "true",
                "PREFECT_RUNNER_SERVER_HOST": LOOPBACK,
                "PREFECT_RUNNER_SERVER_PORT": str(settings.prefect.runner_port),
            },
        )
    )
    return chosen


def _serving_part(settings: Settings) -> Part:
    """The local model server the local rollout platform drives: it serves ``rollout.local_repository``
    (empty until the first rollout) and logs one JSON line per request to ``<home>/logs/serving.log``,
    which ``sluicegate lineage REQUEST_ID`` reads."""
    from tasks.rollout.config import local_repository

    r = settings.rollout
    grpc_port = r.local_grpc.rsplit(":", 1)[1]
    http_port = httpx.URL(r.local_http).port
    repository = local_repository(settings)
    repository.mkdir(parents=True, exist_ok=True)
    token = r.admin_token.get_secret_value() if r.admin_token else local_admin_token(settings)
    argv = [sys.executable, "-m", "serving", "--repo", str(repository), "--grpc-port", grpc_port]
    argv += ["--http-port", str(http_port), "--host", LOOPBACK]
    env = {"SLUICEGATE_SERVING__ADMIN_TOKEN": token, "SLUICEGATE_SERVING__CACHE_DIR": str(settings.home / "cache")}
    return Part("serving", argv, f"{r.local_http.rstrip('/')}/health/live", r.local_grpc, env)


def local_admin_token(settings: Settings) -> str:
    """The local server's admin token, made once per home (mode 0600) when none is configured."""
    import secrets

    from tasks.rollout.config import admin_token_file

    path = admin_token_file(settings)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout).status_code < 500
    except httpx.HTTPError:
        return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill_tree(pid: int, timeout: float) -> None:
    """SIGTERM a process and everything it started, then SIGKILL what is left after ``timeout``."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    # Children spawned while we waited (a runner starting a flow run) are caught here too.
    for leftover in alive + [child for proc in alive for child in _children(proc)]:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    psutil.wait_procs(alive, timeout=5)


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


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
            if healthy(part.health_url):
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
                log_path = str(self.paths.logs / f"{current.name}.log")
                st = self.state.parts.setdefault(current.name, PartState(current.name, current.url, log_path))
                st.status, st.detail = FAILED, str(exc)
                self.state.status = FAILED
                self.state.error = (
                    f"{current.name} failed to start: {exc}\n--- last lines of {st.log} ---\n{tail(Path(st.log))}"
                )
                self.write_state()
                raise
        self.state.status = READY
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
    def run() -> None:
        from sluicegate.metadata import MetadataStore

        store = MetadataStore(settings.metadata_url)
        try:
            store.upgrade()
        finally:
            store.dispose()

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


def _chain(*steps: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for step in steps:
            step()

    return run


def supervisor_alive(paths: Paths) -> bool:
    """True while a supervisor holds the lock (robust against stale pid files)."""
    if not paths.lock.exists():
        return False
    with paths.lock.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def read_state(paths: Paths) -> StackState | None:
    try:
        return StackState.from_json(paths.state.read_text())
    except (OSError, ValueError, KeyError):
        return None


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
        running = alive and st.pid is not None and _running(st.pid, st.created)
        ok = running and name in by_name and healthy(by_name[name].health_url)
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
        while _running(state.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    # Whatever outlived the supervisor (it was SIGKILLed, or crashed) is stopped here.
    for st in state.parts.values() if state else []:
        if st.pid is not None and _running(st.pid, st.created):
            kill_tree(st.pid, settings.stack.stop_timeout)
            killed.append(st.pid)
    return killed


def _running(pid: int, created: float | None = None) -> bool:
    """Alive, not a zombie (exited, not yet reaped), and (when known) the same process we started."""
    try:
        proc = psutil.Process(pid)
        same = created is None or abs(proc.create_time() - created) < 1.0
        return bool(same and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


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
