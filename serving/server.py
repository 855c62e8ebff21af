"""Assembling and running the server process: the repository, telemetry, the data plane, the gRPC port
(serving/grpc_api/server.py) and the HTTP side port (serving/rest_api/side_port.py), models loaded in a
thread; ``main()`` runs it until SIGTERM/SIGINT, then shuts down gracefully: not ready at once, still
serving for ``shutdown_delay_s`` (load balancers take the server out), then draining in-flight requests.

With ``workers`` above 1, ``main()`` runs serving/supervisor.py instead, which starts that many of these
processes (``--worker INDEX``) on the same ports; each is one server whose admin changes reach its
siblings (serving/siblings.py)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.dataplane import DataPlane
from serving.scheduling import apply_cpu_policy
from serving.settings import ServingSettings

if TYPE_CHECKING:
    from serving.dataplane import Telemetry
    from serving.observability.metrics import ServerMetrics
    from serving.observability.pipeline import TelemetryPipeline
    from serving.siblings import WorkerRole

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    settings: ServingSettings
    dataplane: DataPlane
    grpc_server: Any
    side: Any
    health: Any
    grpc_port: int
    http_port: int
    loader: threading.Thread
    tracer_provider: Any = None
    telemetry: Any = None  # serving.observability.pipeline.TelemetryPipeline (None: telemetry off)
    _delay_over: threading.Event = field(default_factory=threading.Event)

    def flush_telemetry(self, timeout: float = 30.0) -> bool:
        """Wait until the monitors and request log have processed everything answered so far."""
        return self.telemetry is None or bool(self.telemetry.flush(timeout))

    def wait_ready(self, timeout: float | None = None) -> bool:
        self.loader.join(timeout)
        return self.dataplane.ready()

    def stop(self, grace: float | None = None, delay: float | None = None) -> None:
        """Shut down the way a load balancer needs it: report not ready at once, keep serving for ``delay``
        seconds (default ``shutdown_delay_s``) while the balancer takes this server out, then stop taking
        requests and let in-flight ones finish (up to ``grace``, default ``drain_timeout_s``), then release
        the models. Tests pass ``delay=0``: nothing routes to them.

        ``end_delay()`` (a second signal) cuts the delay short."""
        grace = self.settings.drain_timeout_s if grace is None else grace
        delay = self.settings.shutdown_delay_s if delay is None else delay
        self.dataplane.stopping = True  # publishes: health NOT_SERVING, ready gauge 0, /health/ready 503
        if self.health is not None:
            # Every service name NOT_SERVING from here on, whatever a late load would publish.
            self.health.enter_graceful_shutdown()
        log.info("stopping: not ready; serving %.1f s more so load balancers take this server out", delay)
        self._delay_over.wait(delay)
        log.info("draining: no new requests; in-flight ones get up to %.1f s", grace)
        drained = self.grpc_server.stop(grace)  # refuses new RPCs at once, returns while in-flight ones run
        self.side.stop()
        drained.wait()
        self.dataplane.close()
        if self.telemetry is not None:
            self.telemetry.close()  # writes the log lines still queued
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes spans still buffered for the OTLP exporter
        log.info("server stopped")

    def end_delay(self) -> None:
        """End ``stop()``'s not-ready delay now (the operator sent a second signal)."""
        self._delay_over.set()


def start(settings: ServingSettings, *, tracer_provider: Any = None, role: WorkerRole | None = None) -> RunningServer:
    """Start both ports at once (liveness answers during loading), then load every model in a thread.

    ``tracer_provider`` replaces the one the settings describe (tests: an in-memory exporter). ``role``: this
    process is that worker of a supervisor (shared metrics files, admin changes sent to its siblings)."""
    from serving.auth import Authorizer
    from serving.grpc_api.server import bind_grpc
    from serving.observability.logs import RequestLogger
    from serving.observability.metrics import ServerMetrics
    from serving.observability.tracing import setup_tracing
    from serving.rest_api.side_port import SidePort

    if not settings.repository:
        raise SystemExit("no model repository: pass --repo PATH|s3://...|models:/name@alias")
    metrics = ServerMetrics(multiprocess_dir=role.metrics_dir if role is not None else None)
    scan = _scanner(settings)

    def on_fallback(model: str, version: str, level: str, index: int, reason: str) -> None:
        metrics.set_level(model, version, level, index)

    provider = tracer_provider or setup_tracing(
        settings.tracing_exporter, settings.tracing_endpoint, settings.server_name
    )
    pipeline, telemetry = _telemetry(settings, metrics, provider)
    if role is None:
        plane = DataPlane(settings, scan, on_fallback=on_fallback, telemetry=telemetry, metrics=metrics)
    else:
        from serving.siblings import SharedDataPlane

        plane = SharedDataPlane(
            settings, scan, on_fallback=on_fallback, telemetry=telemetry, metrics=metrics, role=role
        )
    auth = Authorizer(
        settings.admin_token.get_secret_value() if settings.admin_token else None,
        open_changes=settings.admin_open,
        reads_need_token=settings.read_requires_token,
        on_refused=metrics.refused,
    )
    request_log = (
        RequestLogger(settings.log_sample_rate, max_echo_chars=settings.max_echo_chars) if settings.telemetry else None
    )
    rpc = bind_grpc(settings, plane, metrics, auth=auth, version=_version(), request_log=request_log)
    plane.on_readiness(readiness_publisher(rpc.health, metrics))
    side = SidePort(
        plane,
        metrics,
        host=settings.host,
        port=settings.http_port,
        auth=auth,
        server_name=settings.server_name,
        server_version=_version(),
        settings=settings,
    )
    rpc.server.start()
    side.start()
    log.info("gRPC on %s:%d, HTTP on %s:%d", settings.host, rpc.port, settings.host, side.port)
    loader = threading.Thread(
        target=_load, args=(plane, metrics, settings.repository), name="model-loader", daemon=True
    )
    loader.start()
    return RunningServer(settings, plane, rpc.server, side, rpc.health, rpc.port, side.port, loader, provider, pipeline)


Scan = Callable[[], tuple[list[tuple[str, str, Path, Any]], list[tuple[str, str]]]]


def _scanner(settings: ServingSettings) -> Scan:
    """The data plane's ``scan``: copy the repository in, then list its verified and rejected versions."""
    from serving.repository import ModelRepository

    repository = ModelRepository(
        settings.repository,
        cache_dir=settings.cache_dir,
        mlflow_tracking_uri=settings.mlflow_tracking_uri,
        s3_endpoint_url=settings.s3_endpoint_url,
    )

    def scan() -> tuple[list[tuple[str, str, Path, Any]], list[tuple[str, str]]]:
        repository.materialize()
        found = repository.versions()
        return [(v.model, v.version, v.path, v.config) for v in found], list(repository.rejected)

    return scan


def _telemetry(
    settings: ServingSettings, metrics: ServerMetrics, provider: Any
) -> tuple[TelemetryPipeline | None, Telemetry | None]:
    """The telemetry thread and what the data plane reports to; (None, None) with telemetry off."""
    from serving.dataplane import Telemetry
    from serving.observability.pipeline import TelemetryPipeline
    from serving.observability.tracing import RequestTracing

    if not settings.telemetry:
        return None, None
    # The monitors' batches and the request-log lines run on one thread, off every request's path.
    pipeline = TelemetryPipeline(
        settings.telemetry_max_pending, settings.telemetry_max_pending_mib * 2**20, on_drop=metrics.dropped
    )
    tracing = RequestTracing(provider)
    # No exporter: no spans at all (the log's trace_id then comes from the caller's traceparent).
    return pipeline, Telemetry(metrics, tracing if tracing.recording else None, pipeline)


def readiness_publisher(health_servicer: Any, metrics: ServerMetrics) -> Callable[[bool], None]:
    """What ``DataPlane.on_readiness`` calls: the gRPC health of the whole server ("") and of the inference
    service, and the ``sluicegate_server_ready`` gauge, set from one readiness value."""
    from grpc_health.v1 import health_pb2

    from serving.grpc_api.server import HEALTH_SERVICES

    def publish(ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            health_servicer.set(service, status)
        metrics.ready.set(1 if ready else 0)

    return publish


def _load(plane: DataPlane, metrics: ServerMetrics, repository: str) -> None:
    """The model-loader thread: load every model (each load publishes readiness), then log the outcome."""
    from serving.errors import ServingError
    from serving.redact import mask_text, mask_url, masked_traceback

    try:
        plane.load_all()
    except ServingError as exc:  # a bad source: its message says what to fix (masked: it may hold a URL)
        log.error("loading the repository %s failed: %s", mask_url(repository), mask_text(str(exc)))
    except Exception as exc:
        log.error("loading the repository %s failed:\n%s", mask_url(repository), masked_traceback(exc))
    for model, version, _ in plane.stats():
        level, index, providers = plane.runtime_of(model, version)
        metrics.set_level(model, version, level, index)
        log.info("%s/%s: runtime %s (level %d), providers %s", model, version, level, index, ", ".join(providers))
    log.info("ready: %s", plane.ready())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluicegate")
    except PackageNotFoundError:
        return "0"


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m serving", description="sluicegate KServe V2 gRPC model server")
    parser.add_argument(
        "--repo", dest="repository", help="model repository: PATH, s3://bucket/prefix or models:/name@alias"
    )
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--workers", type=int, help="server processes (0: one per usable CPU; 1: no supervisor)")
    # Set by the supervisor on the processes it starts, not by people.
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = vars(parser.parse_args(argv))
    return {key: value for key, value in args.items() if value is not None}


def main(argv: list[str] | None = None) -> None:
    """Run until SIGTERM or SIGINT; settings from SLUICEGATE_SERVING__* with the flags on top. With more
    than one worker, supervise them instead (serving/supervisor.py); its exit status is the process's."""
    from serving.observability.logs import json_handler

    # A crash in native code (ONNX Runtime, TensorRT, grpc++, the native front end) then leaves the Python
    # stack of every thread on stderr instead of only an exit status (-11) in the supervisor's log.
    faulthandler.enable()
    # One JSON object per line (request logs and everything else), for log shippers.
    # Flushed every 50 ms (and at once for warnings): a write per request line costs more than the line.
    logging.basicConfig(level=logging.INFO, handlers=[json_handler(flush_interval_s=0.05)])
    # Fields no line carries (JsonFormatter writes neither), each a lookup per record: one line per
    # request makes them count.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    args = parse_args(argv)
    index = args.pop("worker", None)
    settings = ServingSettings(**args)
    # Before the gRPC, ONNX Runtime and telemetry threads exist, so they inherit it; a supervisor's workers
    # inherit it through exec as well. Only here: start() also runs inside test and embedding processes,
    # whose threads are not ours to change.
    apply_cpu_policy(settings.cpu_policy)
    role = None
    if index is None:
        from serving.cpus import usable_cpus

        count = settings.workers or usable_cpus()
        if count > 1:
            from serving.supervisor import Supervisor

            raise SystemExit(Supervisor(settings, count).run())
    else:
        from serving.siblings import WorkerRole

        if settings.runtime_dir is None:
            raise SystemExit("--worker is set by the supervisor, with runtime_dir; run python -m serving instead")
        role = WorkerRole(index, settings.runtime_dir)
    running = start(settings, role=role)
    stop = threading.Event()

    def handle(signum: int, _: Any) -> None:
        if stop.is_set():  # a second signal: the operator will not wait out the delay
            log.info("signal %d again: stopping without the rest of the delay", signum)
            running.end_delay()
            return
        log.info("signal %d: draining after %.1f s not ready", signum, settings.shutdown_delay_s)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    if role is not None:
        _watch_supervisor(stop)
    stop.wait()
    running.stop()


def _watch_supervisor(stop: threading.Event) -> None:
    """Stop this worker when its supervisor is gone (killed without passing a signal on): an orphan would
    keep serving on the shared ports with nobody to restart or stop it."""
    parent = os.getppid()

    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent:
                log.error("supervisor (pid %d) is gone: stopping this worker", parent)
                stop.set()

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
