"""Assembling and running the server process: the repository, telemetry, the data plane, the gRPC port
(serving/grpc_api/server.py) and the HTTP side port (serving/rest_api/side_port.py), models loaded in a
thread; ``main()`` runs it until SIGTERM/SIGINT, then shuts down gracefully (readiness drops first,
in-flight requests finish)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.dataplane import DataPlane
from serving.settings import ServingSettings

if TYPE_CHECKING:
    from serving.dataplane import Telemetry
    from serving.observability.metrics import ServerMetrics
    from serving.observability.pipeline import TelemetryPipeline

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

    def flush_telemetry(self, timeout: float = 30.0) -> bool:
        """Wait until the monitors and request log have processed everything answered so far."""
        return self.telemetry is None or bool(self.telemetry.flush(timeout))

    def wait_ready(self, timeout: float | None = None) -> bool:
        self.loader.join(timeout)
        return self.dataplane.ready()

    def stop(self, grace: float | None = None) -> None:
        """Drop readiness, stop taking RPCs, let in-flight ones finish (up to ``grace``), release models."""
        from grpc_health.v1 import health_pb2

        grace = self.settings.drain_timeout_s if grace is None else grace
        self.dataplane.stopping = True
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_server.stop(grace).wait()
        self.dataplane.close()
        self.side.stop()
        if self.telemetry is not None:
            self.telemetry.close()  # writes the log lines still queued
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes spans still buffered for the OTLP exporter
        log.info("server stopped")


def start(settings: ServingSettings, *, tracer_provider: Any = None) -> RunningServer:
    """Start both ports at once (liveness answers during loading), then load every model in a thread.

    ``tracer_provider`` replaces the one the settings describe (tests: an in-memory exporter)."""
    from serving.grpc_api.server import bind_grpc
    from serving.observability.logs import RequestLogger
    from serving.observability.metrics import ServerMetrics
    from serving.observability.tracing import setup_tracing
    from serving.rest_api.side_port import SidePort

    if not settings.repository:
        raise SystemExit("no model repository: pass --repo PATH|s3://...|models:/name@alias")
    metrics = ServerMetrics()
    scan = _scanner(settings)

    def on_fallback(model: str, version: str, level: str, index: int, reason: str) -> None:
        metrics.set_level(model, version, level, index)

    provider = tracer_provider or setup_tracing(
        settings.tracing_exporter, settings.tracing_endpoint, settings.server_name
    )
    pipeline, telemetry = _telemetry(settings, metrics, provider)
    plane = DataPlane(settings, scan, on_fallback=on_fallback, telemetry=telemetry, metrics=metrics)
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    request_log = RequestLogger(settings.log_sample_rate) if settings.telemetry else None
    rpc = bind_grpc(settings, plane, metrics, admin_token=token, version=_version(), request_log=request_log)
    side = SidePort(
        plane,
        metrics,
        host=settings.host,
        port=settings.http_port,
        admin_token=token,
        server_name=settings.server_name,
        server_version=_version(),
    )
    rpc.server.start()
    side.start()
    log.info("gRPC on %s:%d, HTTP on %s:%d", settings.host, rpc.port, settings.host, side.port)
    loader = threading.Thread(
        target=_load, args=(plane, metrics, rpc.health, settings.repository), name="model-loader", daemon=True
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


def _load(plane: DataPlane, metrics: ServerMetrics, health_servicer: Any, repository: str) -> None:
    """The model-loader thread: load every model, then report readiness (metrics, log, gRPC health)."""
    from grpc_health.v1 import health_pb2

    try:
        plane.load_all()
    except Exception:
        log.exception("loading the repository %s failed", repository)
    ready = plane.ready()
    metrics.ready.set(1 if ready else 0)
    for model, version, _ in plane.stats():
        level, index, providers = plane.runtime_of(model, version)
        metrics.set_level(model, version, level, index)
        log.info("%s/%s: runtime %s (level %d), providers %s", model, version, level, index, ", ".join(providers))
    if ready:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("ready: %s", ready)


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
    args = vars(parser.parse_args(argv))
    return {key: value for key, value in args.items() if value is not None}


def main(argv: list[str] | None = None) -> None:
    """Run until SIGTERM or SIGINT; settings from SLUICEGATE_SERVING__* with the flags on top."""
    from serving.observability.logs import json_handler

    # One JSON object per line (request logs and everything else), for log shippers.
    # Flushed every 50 ms (and at once for warnings): a write per request line costs more than the line.
    logging.basicConfig(level=logging.INFO, handlers=[json_handler(flush_interval_s=0.05)])
    # Fields no line carries (JsonFormatter writes neither), each a lookup per record: one line per
    # request makes them count.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    settings = ServingSettings(**parse_args(argv))
    running = start(settings)
    stop = threading.Event()

    def handle(signum: int, _: Any) -> None:
        log.info("signal %d: draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    stop.wait()
    running.stop()
