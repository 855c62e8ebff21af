"""The model server's settings: one pydantic-settings root (env prefix ``SLUICEGATE_SERVING__``), read once
at start-up and passed down. Separate from the platform's settings because the server image carries
only serving dependencies."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from serving.errors import ECHO_CHARS
from serving.scheduling import CpuPolicy

MIB = 1024 * 1024


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_SERVING__", extra="forbid", frozen=True)

    repository: str = Field(
        "", description="Model repository: a directory, s3://bucket/prefix, or models:/<name>@<alias> (MLflow)."
    )
    host: str = Field("127.0.0.1", description="Address both ports bind to (0.0.0.0 inside a container).")
    grpc_port: int = Field(8001, ge=0, le=65535, description="KServe V2 gRPC port (0: pick a free one).")
    http_port: int = Field(8000, ge=0, le=65535, description="Health, metrics, V2 REST and admin port (0: pick).")
    workers: int = Field(
        0,
        ge=0,
        description="Server processes sharing both ports (SO_REUSEPORT; the kernel spreads connections, not "
        "requests). 0: one per CPU this process may use (its affinity, bounded by the cgroup CPU quota, e.g. a "
        "Kubernetes CPU limit). 1: one process, no supervisor. Each process loads every model (memory x N).",
    )
    reuse_port: bool = Field(
        False,
        description="Bind both ports with SO_REUSEPORT so several server processes share them; set by the "
        "supervisor for its workers. Off: a second server on a taken port fails to start.",
    )
    runtime_dir: Path | None = Field(
        None,
        description="With workers: the private folder (made 0700) for their sockets, shared state and metrics "
        "files; emptied of those at start. Unset: a new temporary folder, removed at exit.",
    )
    native_front: Literal["auto", "on", "off"] = Field(
        "auto",
        description="The gRPC port's front end. auto: the native one (serving/native, C++ grpc++: the common "
        "ModelInfer is checked, batched and answered without Python per request; everything else is passed to "
        "the grpcio server on a private socket) where it is built (make install), else grpcio alone. on: "
        "refuse to start without it. off: grpcio alone.",
    )
    cpu_policy: CpuPolicy = Field(
        "batch",
        description="Linux scheduling policy of the server's threads (serving/scheduling.py). batch: SCHED_BATCH, "
        "the same fair share but a waking thread does not preempt the one running inference (more throughput, "
        "no privilege needed). normal: the kernel's default, SCHED_OTHER.",
    )
    grpc_workers: int = Field(
        64, ge=1, description="gRPC handler threads; above the expected concurrency so batches can form."
    )
    max_message_bytes: int = Field(100 * MIB, ge=MIB, description="Largest gRPC message, both directions.")
    keepalive_time_ms: int = Field(30_000, ge=1000, description="Server keepalive ping interval.")
    keepalive_timeout_ms: int = Field(10_000, ge=1000, description="Wait for a keepalive ack before closing.")
    min_client_ping_interval_ms: int = Field(
        10_000, ge=0, description="Shortest client ping interval accepted (clients pinging faster are cut off)."
    )
    runtime_order: tuple[str, ...] = Field(
        ("tensorrt", "onnxruntime", "rules"), description="Runtimes tried per model version, best first."
    )
    tensorrt_engine_cache: bool = Field(
        True,
        description="Build TensorRT engines from model.onnx where model.plan is missing or built for another "
        "GPU/TensorRT, cached under cache_dir/tensorrt-engines (a volume shared by pods of one GPU type).",
    )
    tensorrt_fp16: bool = Field(True, description="FP16 kernels in engines built here, where the GPU has fast FP16.")
    ort_threads: int = Field(1, ge=0, description="ONNX Runtime intra-op threads per session (0: all cores).")
    max_consecutive_errors: int = Field(5, ge=1, description="Runtime errors in a row before dropping a level.")
    probe_interval_s: float = Field(30.0, ge=0, description="How often a fallen-back model retries its better runtime.")
    max_queue_delay_us: int | None = Field(
        None, ge=0, description="Override every model's batching delay (microseconds); unset: config.json's."
    )
    max_elements: int = Field(64 * MIB, ge=1, description="Most tensor elements in one request.")
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token every call that changes what is served needs (repository load/unload, traffic "
        "weights, any admin route), on gRPC (metadata authorization: Bearer <token>) and HTTP.",
    )
    admin_open: bool = Field(
        False,
        description="With no admin_token: accept changing calls from anyone (local development only). Off: they "
        "are refused until a token is set.",
    )
    read_requires_token: bool = Field(
        False,
        description="Repository index and traffic-weight reads need the admin token too (default: open, like "
        "health and metadata).",
    )
    max_echo_chars: int = Field(
        ECHO_CHARS, ge=16, description="Longest request field (model name, version, id) echoed in logs and errors."
    )
    # The HTTP side port (uvicorn): every limit holds while the request is read, not after.
    http_max_body_bytes: int = Field(
        100 * MIB, ge=1024, description="Largest HTTP request body, enforced while reading."
    )
    http_header_timeout_s: float = Field(10.0, gt=0, description="Time a client has to send a request's headers.")
    http_body_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for the next piece of a request body before the connection is closed."
    )
    http_keepalive_s: float = Field(5.0, gt=0, description="Idle keep-alive connections are closed after this.")
    http_max_connections: int = Field(
        256, ge=1, description="Concurrent HTTP connections; more are answered 503 instead of holding memory."
    )
    http_max_json_depth: int = Field(32, ge=2, description="Deepest nesting of a JSON request body (deeper: 400).")
    # TLS for both ports; the rollout's admin calls and the stack's clients use the same files.
    tls_cert_file: Path | None = Field(
        None, description="PEM server certificate (chain) for gRPC and HTTP; unset: no TLS."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: clients must present a certificate it signed (mutual TLS)."
    )
    shutdown_delay_s: float = Field(
        5.0,
        ge=0,
        description="After SIGTERM, seconds the server keeps serving while reporting not ready, so load balancers "
        "take it out first; then it stops accepting and drains (drain_timeout_s). Keep the pod's preStop and "
        "terminationGracePeriodSeconds above delay + drain.",
    )
    mlflow_tracking_uri: str | None = Field(None, description="MLflow server for models:/ repositories.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint for s3:// repositories (MinIO, moto).")
    cache_dir: Path = Field(Path(".sluicegate/serving-cache"), description="Where remote repositories are copied.")
    drain_timeout_s: float = Field(20.0, ge=0, description="Grace period for in-flight requests on shutdown.")
    server_name: str = Field("sluicegate", description="Name reported by ServerMetadata.")
    telemetry: bool = Field(
        True, description="Drift/entropy monitors, tracing and request logs (off: request metrics only)."
    )
    telemetry_max_pending: int = Field(
        10_000,
        ge=1,
        description="Monitor batches and log lines queued for the telemetry thread before new ones are dropped.",
    )
    telemetry_max_pending_mib: int = Field(
        64, ge=0, description="Request inputs (MiB) queued log lines may hold before new lines are dropped."
    )
    # Observability (serving/observability/): drift, output entropy, request logs, tracing.
    drift_window: int = Field(1000, ge=1, description="Images per feature in the drift monitor's sliding window.")
    drift_test_every: int = Field(100, ge=1, description="Images between two KS tests of the drift window.")
    drift_min_samples: int = Field(
        300, ge=1, description="Images in the window before the first KS test (smaller windows alarm by chance)."
    )
    drift_test_min_interval_s: float = Field(
        1.0,
        ge=0,
        description="Seconds at least between two KS tests of one version (0: by drift_test_every only); also"
        " the drift sample: at most drift_window images per interval are featurized, spread over it (0: every one).",
    )
    drift_ks_threshold: float = Field(
        0.15, gt=0, le=1, description="KS statistic above which a feature has drifted (with drift_p_threshold)."
    )
    drift_p_threshold: float = Field(
        0.01, gt=0, le=1, description="KS p-value below which a drift is not chance (with drift_ks_threshold)."
    )
    entropy_window: int = Field(500, ge=1, description="Answered rows in the output-entropy window.")
    entropy_min_rows: int = Field(100, ge=1, description="Rows in the entropy window before collapse is judged.")
    entropy_collapse_std_bits: float = Field(
        0.05, ge=0, description="Collapse when the window's entropy std (bits) is at most this and one class dominates."
    )
    entropy_collapse_class_share: float = Field(
        0.95, gt=0, le=1, description="Share of the window's rows one predicted class needs for a collapse."
    )
    log_sample_rate: float = Field(
        1.0, ge=0, le=1, description="Fraction of successful requests written to the JSON request log (errors: all)."
    )
    request_log_file: Path | None = Field(
        None,
        description="Append the request records (JSON lines) to this file (opened O_APPEND: several server "
        "processes may share it) instead of standard error.",
    )
    tracing_exporter: Literal["none", "otlp"] = Field(
        "none", description="OpenTelemetry span export: none, or otlp (OTLP/gRPC to tracing_endpoint)."
    )
    tracing_endpoint: str | None = Field(
        None,
        description="OTLP collector for tracing_exporter=otlp, e.g. http://otel-collector:4317 (unset: localhost).",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ServingSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both (TLS on) or neither (TLS off)")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file as well")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None
