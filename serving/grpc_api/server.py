"""The gRPC port: one ``grpc.server`` carrying KServe V2 ``inference.GRPCInferenceService`` (with Triton's
extensions), ``sluicegate.admin.TrafficAdmin`` and ``grpc.health.v1.Health``, each servicer method
wrapped once by serving/grpc_api/rpc_errors.py; TLS (optionally mutual) when the settings name a
certificate. serving/server.py builds it beside the HTTP side port and
starts both."""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.auth import Authorizer
from serving.dataplane import DataPlane
from serving.grpc_api.rpc_errors import guard_servicer
from serving.grpc_api.servicer import ADMIN_METHODS, INFERENCE_METHODS, AdminServicer, InferenceServicer
from serving.observability.metrics import ServerMetrics
from serving.proto import admin_pb2_grpc, grpc_service_pb2_grpc
from serving.settings import ServingSettings

log = logging.getLogger(__name__)

# The health services a load balancer or Triton-style probe may ask: the whole server and the inference
# service by name; both always carry the same status (serving/server.py's readiness_publisher).
HEALTH_SERVICES = ("", "inference.GRPCInferenceService")


def grpc_options(settings: ServingSettings) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_client_ping_interval_ms),
        ("grpc.http2.max_pings_without_data", 0),
        # With grpc's default (1) a stale server silently shared the port (FACTS.md): fail loudly instead,
        # unless this is one of several worker processes meant to share it (serving/supervisor.py).
        ("grpc.so_reuseport", int(settings.reuse_port)),
    ]


@dataclass(frozen=True)
class GrpcPort:
    """The bound, not yet started gRPC server; ``health`` reports NOT_SERVING until the models load.
    ``secure``: bound with TLS (then there is no plaintext port at all)."""

    server: Any  # grpc.Server
    health: Any  # grpc_health.v1.health.HealthServicer
    port: int
    secure: bool = False


def native_front(settings: ServingSettings, folder: Path | None = None) -> ModuleType | None:
    """The native front end's module where ``native_front`` asks for it and it is built, else None.
    ``folder``: where it was built (default: serving/native).

    Raises:
        SystemExit: ``native_front=on`` and it cannot be loaded.
    """
    if settings.native_front == "off":
        return None
    from serving.native import load

    native, why = load() if folder is None else load(folder)
    if native is None:
        if settings.native_front == "on":
            raise SystemExit(f"native_front=on, but the native front end cannot be loaded: {why}")
        log.info("gRPC on grpcio alone: the native front end is %s", why)
    return native


def tls_files(settings: ServingSettings) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate, client CA or None) as read from the settings' files.

    Raises:
        SystemExit: A file cannot be read.
    """
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    try:
        cert, key = settings.tls_cert_file.read_bytes(), settings.tls_key_file.read_bytes()
        client_ca = settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file else None
    except OSError as exc:
        raise SystemExit(f"cannot read the TLS files for gRPC: {exc}") from exc
    return key, cert, client_ca


def server_credentials(settings: ServingSettings) -> grpc.ServerCredentials:
    """The server certificate and key, and with ``tls_client_ca_file`` the CA client certificates must be
    signed by (mutual TLS: a client without one is refused in the handshake).

    Raises:
        SystemExit: A file cannot be read.
    """
    key, cert, client_ca = tls_files(settings)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def bind_grpc(
    settings: ServingSettings,
    plane: DataPlane,
    metrics: ServerMetrics,
    *,
    auth: Authorizer,
    version: str,
    request_log: Any = None,
) -> GrpcPort:
    """Register the inference, admin and health services on a new server and bind its port.

    Raises:
        SystemExit: The gRPC address cannot be bound (in use?).
    """
    native = native_front(settings)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.grpc_workers, thread_name_prefix="grpc"),
        options=grpc_options(settings),
    )
    behind = native is not None
    inference = InferenceServicer(
        plane,
        metrics,
        name=settings.server_name,
        version=version,
        max_elements=settings.max_elements,
        request_log=request_log,
        auth=auth,
        behind_front=behind,
    )
    guard_servicer(inference, "inference.GRPCInferenceService", INFERENCE_METHODS)
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(inference, server)  # type: ignore[no-untyped-call]
    admin_servicer = AdminServicer(plane, auth, behind_front=behind)
    admin = guard_servicer(admin_servicer, "sluicegate.admin.TrafficAdmin", ADMIN_METHODS)
    admin_pb2_grpc.add_TrafficAdminServicer_to_server(admin, server)  # type: ignore[no-untyped-call]
    health_servicer = health.HealthServicer()
    for service in HEALTH_SERVICES:
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.grpc_port}"
    if native is not None:
        from serving.grpc_api.native_port import NativePort

        front = NativePort(
            native, server, plane, metrics, max_elements=settings.max_elements, request_log=inference.request_log
        )
        port = front.bind(address, grpc_options(settings), tls_files(settings) if settings.tls else None)
        if port == 0:
            raise SystemExit(f"cannot bind gRPC to {address} (in use?)")
        plane.on_readiness(front.sync)  # lanes follow every load, unload and runtime change
        return GrpcPort(front, health_servicer, port, secure=settings.tls)
    if settings.tls:
        port = server.add_secure_port(address, server_credentials(settings))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise SystemExit(f"cannot bind gRPC to {address} (in use?)")
    return GrpcPort(server, health_servicer, port, secure=settings.tls)
