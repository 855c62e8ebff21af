"""Assembling and running the server: the repository, the data plane, gRPC (V2 + health + admin) and the
HTTP side port; graceful shutdown on SIGTERM (readiness drops first, in-flight requests finish)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from serving.dataplane import DataPlane
from serving.settings import ServingSettings

log = logging.getLogger(__name__)


def grpc_options(settings: ServingSettings) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_client_ping_interval_ms),
        ("grpc.http2.max_pings_without_data", 0),
        # With grpc's default (1) a stale server silently shared the port (FACTS.md): fail loudly instead.
        ("grpc.so_reuseport", 0),
    ]


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
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from serving.http import SidePort
    from serving.metrics import ServerMetrics
    from serving.observability.pipeline import TelemetryPipeline
    from serving.proto import admin_pb2_grpc, grpc_service_pb2_grpc
    from serving.repository import ModelRepository
    from serving.rpc_errors import guard_servicer
    from serving.servicer import ADMIN_METHODS, INFERENCE_METHODS, AdminServicer, InferenceServicer

    if not settings.repository:
        raise SystemExit("no model repository: pass --repo PATH|s3://...|models:/name@alias")
    metrics = ServerMetrics()
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

    def on_fallback(model: str, version: str, level: str, index: int, reason: str) -> None:
        metrics.set_level(model, version, level, index)

    from serving.dataplane import Telemetry
    from serving.observability.logs import RequestLogger
    from serving.observability.tracing import RequestTracing, setup_tracing

    provider = tracer_provider or setup_tracing(
        settings.tracing_exporter, settings.tracing_endpoint, settings.server_name
    )
    pipeline = None
    telemetry = None
    if settings.telemetry:
        # The monitors' batches and the request-log lines run on one thread, off every request's path.
        pipeline = TelemetryPipeline(
            settings.telemetry_max_pending, settings.telemetry_max_pending_mib * 2**20, on_drop=metrics.dropped
        )
        tracing = RequestTracing(provider)
        # No exporter: no spans at all (the log's trace_id then comes from the caller's traceparent).
        telemetry = Telemetry(metrics, tracing if tracing.recording else None, pipeline)
    plane = DataPlane(settings, scan, on_fallback=on_fallback, telemetry=telemetry, metrics=metrics)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="grpc"),
        options=grpc_options(settings),
    )
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    inference = InferenceServicer(
        plane,
        metrics,
        name=settings.server_name,
        version=_version(),
        max_elements=settings.max_elements,
        request_log=RequestLogger(settings.log_sample_rate) if settings.telemetry else None,
    )
    guard_servicer(inference, "inference.GRPCInferenceService", INFERENCE_METHODS)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(inference, server)  # type: ignore[no-untyped-call]
    admin = guard_servicer(AdminServicer(plane, token), "sluicegate.admin.TrafficAdmin", ADMIN_METHODS)
    admin_pb2_grpc.add_TrafficAdminServicer_to_server(admin, server)  # type: ignore[no-untyped-call]
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    grpc_port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    if grpc_port == 0:
        raise SystemExit(f"cannot bind gRPC to {settings.host}:{settings.grpc_port} (in use?)")
    side = SidePort(
        plane,
        metrics,
        host=settings.host,
        port=settings.http_port,
        admin_token=token,
        server_name=settings.server_name,
        server_version=_version(),
    )
    server.start()
    side.start()
    log.info("gRPC on %s:%d, HTTP on %s:%d", settings.host, grpc_port, settings.host, side.port)

    def load() -> None:
        try:
            plane.load_all()
        except Exception:
            log.exception("loading the repository %s failed", settings.repository)
        ready = plane.ready()
        metrics.ready.set(1 if ready else 0)
        for model, version, _ in plane.stats():
            level, index, providers = plane.runtime_of(model, version)
            metrics.set_level(model, version, level, index)
            log.info("%s/%s: runtime %s (level %d), providers %s", model, version, level, index, ", ".join(providers))
        if ready:
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: %s", ready)

    loader = threading.Thread(target=load, name="model-loader", daemon=True)
    loader.start()
    return RunningServer(
        settings, plane, server, side, health_servicer, grpc_port, side.port, loader, provider, pipeline
    )


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
