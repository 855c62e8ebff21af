"""``python -m serving`` with more than one worker: a small supervisor that loads no model itself.

It reserves both ports (binding SO_REUSEPORT sockets it never listens on, so port 0 becomes a fixed free
port that stays taken), prepares a private runtime folder (0700: the workers' sockets, the shared state
file, prometheus-client's multiprocess files and the workers' secret), then starts ``workers`` copies of
``python -m serving --worker INDEX``. Each worker binds both ports with SO_REUSEPORT, so the kernel spreads
incoming connections (not requests: one client channel stays on one worker) over the workers.

A worker that dies is started again, after a back-off that grows while restarts keep failing; its
metrics files are marked dead. SIGTERM/SIGINT are passed to every worker, which shuts down as one server
does (not ready, ``shutdown_delay_s``, drain); a second signal is passed on too (ends the delay). The
supervisor exits 0 when every worker stopped cleanly, 1 when a worker could not start at all or failed
to restart ``MAX_FAILED_STARTS`` times in a row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.settings import ServingSettings
from serving.siblings import socket_path

log = logging.getLogger(__name__)

MAX_FAILED_STARTS = 5
# A worker that has served this long has started well: its next death starts the back-off afresh.
STABLE_S = 60.0
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
POLL_S = 0.2


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    pid: int = 0
    started: float = 0.0
    joined: bool = False
    failed_starts: int = 0  # exits before joining, in a row: MAX_FAILED_STARTS stops the server
    crashes: int = 0  # exits within STABLE_S of starting, in a row: the back-off
    restart_at: float | None = None
    exit_code: int | None = None


class Supervisor:
    """Runs ``count`` workers of the server ``settings`` describe (see the module docstring)."""

    def __init__(self, settings: ServingSettings, count: int) -> None:
        self.settings, self.count = settings, count
        self.workers = [Worker(index) for index in range(count)]
        self._stop = threading.Event()
        self._signals = 0
        self.runtime_dir = Path()  # run() makes it
        self.ports = (0, 0)

    def run(self) -> int:
        reserved = [
            reserve_port(self.settings.host, port) for port in (self.settings.grpc_port, self.settings.http_port)
        ]
        self.ports = (int(reserved[0].getsockname()[1]), int(reserved[1].getsockname()[1]))
        self.runtime_dir = prepare_runtime_dir(self.settings.runtime_dir)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info(
            "supervisor (pid %d): %d workers on gRPC %s:%d and HTTP %s:%d, runtime folder %s",
            os.getpid(),
            self.count,
            self.settings.host,
            self.ports[0],
            self.settings.host,
            self.ports[1],
            self.runtime_dir,
        )
        try:
            try:
                for worker in self.workers:
                    self._spawn(worker)
                code = self._watch()
            finally:
                clean = self._stop_all()
        finally:
            for reservation in reserved:
                reservation.close()
            if self.settings.runtime_dir is None:  # ours, made for this run
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
        code = code or int(not clean)
        log.info("supervisor stopped (exit %d)", code)
        return code

    # -- the loop ----------------------------------------------------------------------------------

    def _watch(self) -> int:
        """Restart workers until a signal (0) or a worker that cannot start (1)."""
        starting = True  # until every worker joined once: a failure then is a failed server start
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            for worker in self.workers:
                if worker.proc is None:
                    if worker.restart_at is not None and now >= worker.restart_at:
                        self._spawn(worker)
                    continue
                if not worker.joined and socket_path(self.runtime_dir, worker.index).exists():
                    worker.joined = True
                code = worker.proc.poll()
                if code is None:
                    if worker.joined and now - worker.started >= STABLE_S:
                        worker.failed_starts = worker.crashes = 0
                    continue
                if self._stop.is_set():
                    break
                self._reap(worker, code)
                if not worker.joined:
                    worker.failed_starts += 1
                    if starting or worker.failed_starts >= MAX_FAILED_STARTS:
                        log.error(
                            "worker %d could not start (exit %d, %d time(s) in a row): stopping the server",
                            worker.index,
                            code,
                            worker.failed_starts,
                        )
                        return 1
                worker.crashes = worker.crashes + 1 if now - worker.started < STABLE_S else 1
                delay = BACKOFF_S[min(worker.crashes, len(BACKOFF_S)) - 1]
                log.error(
                    "worker %d (pid %d) exited with %d%s; restarting in %.1f s",
                    worker.index,
                    worker.pid,
                    code,
                    signal_name(code),
                    delay,
                )
                worker.restart_at = now + delay
            starting = starting and not all(w.joined for w in self.workers)
        return 0

    def _spawn(self, worker: Worker) -> None:
        flags = ["--repo", self.settings.repository, "--host", self.settings.host]
        flags += ["--grpc-port", str(self.ports[0]), "--http-port", str(self.ports[1]), "--worker", str(worker.index)]
        env = {
            **os.environ,
            # Read by prometheus_client when the worker imports it: every value goes to the shared files.
            "PROMETHEUS_MULTIPROC_DIR": str(self.runtime_dir / "metrics"),
            "SLUICEGATE_SERVING__REUSE_PORT": "true",
            "SLUICEGATE_SERVING__RUNTIME_DIR": str(self.runtime_dir),
            "SLUICEGATE_SERVING__WORKERS": "1",
        }
        # stdout/stderr inherited: every worker writes its JSON lines to the server's own streams.
        worker.proc = subprocess.Popen([sys.executable, "-m", "serving", *flags], env=env)
        worker.started, worker.joined, worker.restart_at, worker.exit_code = time.monotonic(), False, None, None
        worker.pid = worker.proc.pid
        log.info("worker %d started (pid %d)", worker.index, worker.proc.pid)

    def _reap(self, worker: Worker, code: int) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        assert worker.proc is not None
        # Its live gauges (readiness, monitors) leave the aggregate; its counters stay counted.
        mark_process_dead(worker.proc.pid, str(self.runtime_dir / "metrics"))  # type: ignore[no-untyped-call]
        socket_path(self.runtime_dir, worker.index).unlink(missing_ok=True)
        worker.exit_code, worker.proc = code, None

    # -- stopping ----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _: Any) -> None:
        self._signals += 1
        log.info(
            "supervisor: signal %d (%s time); passing it to the workers",
            signum,
            "first" if self._signals == 1 else "again",
        )
        self._stop.set()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGTERM)

    def _stop_all(self) -> bool:
        """SIGTERM every worker still running (a no-op after a signal: they have it), wait for them; whether
        every one stopped cleanly (exit 0, or killed by the signal before it could handle it)."""
        clean = True
        deadline = time.monotonic() + self.settings.shutdown_delay_s + self.settings.drain_timeout_s + 30
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None and not self._signals:
                worker.proc.send_signal(signal.SIGTERM)
        for worker in self.workers:
            if worker.proc is None:
                continue
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in time; killing it", worker.index)
                worker.proc.kill()
                worker.proc.wait()
            self._reap(worker, worker.proc.returncode)
            if worker.exit_code not in (0, -signal.SIGTERM):
                log.error("worker %d exited with %d%s", worker.index, worker.exit_code, signal_name(worker.exit_code))
                clean = False
        return clean


def signal_name(code: int | None) -> str:
    """`` (SIGSEGV)`` for an exit status that is a signal's (negative, as subprocess reports it), else ``""``:
    the operator reading the log should not need to know that -11 is a crash and -9 the OOM killer."""
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, never listening SO_REUSEPORT socket: keeps ``port`` (0: a free one) for the workers.

    Raises:
        SystemExit: The port is taken by a process that does not share it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port and _answers(family, host, port):
        # SO_REUSEPORT would let us share it silently with a stale server of the same user (FACTS.md).
        raise SystemExit(f"{host}:{port} is already served by another process: stop it or pick another port")
    reservation = socket.socket(family, socket.SOCK_STREAM)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind((host, port))
    except OSError as exc:
        reservation.close()
        raise SystemExit(f"cannot bind {host}:{port} ({exc.strerror}): is another server on it?") from exc
    return reservation


def _answers(family: socket.AddressFamily, host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (the wildcard address asked on loopback)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((target, port)) == 0


def prepare_runtime_dir(given: Path | None) -> Path:
    """The runtime folder, private (0700) and without a previous run's sockets, state or metrics."""
    root = Path(tempfile.mkdtemp(prefix="sluicegate-serving-")) if given is None else Path(given)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)  # an existing folder keeps its mode under mkdir
    for sub in ("metrics", "workers"):
        folder = root / sub
        folder.mkdir(exist_ok=True)
        for leftover in [*folder.glob("*.db"), *folder.glob("*.sock")]:
            leftover.unlink()
    for name in ("state.json", "state.partial"):
        (root / name).unlink(missing_ok=True)
    secret = root / "secret"
    secret.touch(mode=0o600)
    secret.write_text(secrets.token_hex(32))
    return root
