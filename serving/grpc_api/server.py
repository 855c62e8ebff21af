"""The gRPC port: one ``grpc.server`` carrying KServe V2 ``inference.GRPCInferenceService`` (with Triton's
extensions), ``sluicegate.admin.TrafficAdmin`` and ``grpc.health.v1.Health``, each servicer method
wrapped once by serving/grpc_api/rpc_errors.py. serving/server.py builds it beside the HTTP side port and
starts both."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.dataplane import DataPlane
from serving.grpc_api.rpc_errors import guard_servicer
from serving.grpc_api.servicer import ADMIN_METHODS, INFERENCE_METHODS, AdminServicer, InferenceServicer
from serving.observability.metrics import ServerMetrics
from serving.proto import admin_pb2_grpc, grpc_service_pb2_grpc
from serving.settings import ServingSettings


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


@dataclass(frozen=True)
class GrpcPort:
    """The bound, not yet started gRPC server; ``health`` reports NOT_SERVING until the models load."""

    server: Any  # grpc.Server
    health: Any  # grpc_health.v1.health.HealthServicer
    port: int


def bind_grpc(
    settings: ServingSettings,
    plane: DataPlane,
    metrics: ServerMetrics,
    *,
    admin_token: str | None,
    version: str,
    request_log: Any = None,
) -> GrpcPort:
    """Register the inference, admin and health services on a new server and bind its port.

    Raises:
        SystemExit: The gRPC address cannot be bound (in use?).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="grpc"),
        options=grpc_options(settings),
    )
    inference = InferenceServicer(
        plane,
        metrics,
        name=settings.server_name,
        version=version,
        max_elements=settings.max_elements,
        request_log=request_log,
    )
    guard_servicer(inference, "inference.GRPCInferenceService", INFERENCE_METHODS)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(inference, server)  # type: ignore[no-untyped-call]
    admin = guard_servicer(AdminServicer(plane, admin_token), "sluicegate.admin.TrafficAdmin", ADMIN_METHODS)
    admin_pb2_grpc.add_TrafficAdminServicer_to_server(admin, server)  # type: ignore[no-untyped-call]
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    if port == 0:
        raise SystemExit(f"cannot bind gRPC to {settings.host}:{settings.grpc_port} (in use?)")
    return GrpcPort(server, health_servicer, port)
