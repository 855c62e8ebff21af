"""The model server's settings: one pydantic-settings root (env prefix ``SLUICEGATE_SERVING__``), read once
at start-up and passed down. Separate from the platform's settings because the server image carries
only serving dependencies."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

MIB = 1024 * 1024


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_SERVING__", extra="forbid", frozen=True)

    repository: str = Field(
        "", description="Model repository: a directory, s3://bucket/prefix, or models:/<name>@<alias> (MLflow)."
    )
    host: str = Field("127.0.0.1", description="Address both ports bind to (0.0.0.0 inside a container).")
    grpc_port: int = Field(8001, ge=0, le=65535, description="KServe V2 gRPC port (0: pick a free one).")
    http_port: int = Field(8000, ge=0, le=65535, description="Health, metrics, V2 REST and admin port (0: pick).")
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
    admin_token: SecretStr | None = Field(None, description="Bearer token of the admin calls (traffic weights).")
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
    tracing_exporter: Literal["none", "otlp"] = Field(
        "none", description="OpenTelemetry span export: none, or otlp (OTLP/gRPC to tracing_endpoint)."
    )
    tracing_endpoint: str | None = Field(
        None,
        description="OTLP collector for tracing_exporter=otlp, e.g. http://otel-collector:4317 (unset: localhost).",
    )
