"""What the embedded stack runs: each part's command line, health URL and environment (S3+SQS on
moto, the Prefect server, the MLflow server, the local model server, the event bridge and the
runner), and the environment every part and flow run shares. A part whose service is configured
externally (a URL setting) is left out."""

from __future__ import annotations

import os
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sluicegate import storage
from sluicegate.settings import LOOPBACK, RolloutSettings, Settings
from tasks.rollout.local import ClientTls, client_tls

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
    tls: ClientTls | None = None  # what the health check needs for a TLS part (the model server)

    def verify(self) -> ssl.SSLContext | bool:
        """httpx's ``verify=`` for this part's health URL."""
        return self.tls.ssl_context() if self.tls is not None else True


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
    chosen: list[Part] = []
    if settings.storage.embedded:
        chosen.append(_s3_part(settings))
    if settings.prefect.embedded:
        chosen.append(_prefect_part(settings))
    if settings.mlflow.embedded:
        chosen.append(_mlflow_part(settings))
    if settings.stack.serving:
        chosen.append(_serving_part(settings))
    chosen.append(_bridge_part(settings))
    chosen.append(_runner_part(settings))
    return chosen


def _s3_part(settings: Settings) -> Part:
    url = settings.storage.url
    argv = [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(settings.storage.port)]
    return Part("s3", argv, f"{url}/moto-api/data.json", url)


def _prefect_part(settings: Settings) -> Part:
    argv = [_bin("prefect"), "server", "start", "--host", LOOPBACK, "--port", str(settings.prefect.port)]
    if not settings.prefect.ui:
        argv.append("--no-ui")
    return Part("prefect", argv, f"{settings.prefect.url}/health", settings.prefect.url.removesuffix("/api"))


def _mlflow_part(settings: Settings) -> Part:
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
    return Part(
        "mlflow",
        argv,
        f"{settings.mlflow.url}/health",
        settings.mlflow.url,
        {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )


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
    # One process, not one per core: on a developer's box the stack's Prefect, MLflow, S3 and training
    # share the cores with it, a local canary sends a trickle (one connection lands on one worker
    # anyway), and every worker would hold its own copy of each model.
    env["SLUICEGATE_SERVING__WORKERS"] = "1"
    env.update(_serving_tls_env(r))
    return Part("serving", argv, f"{r.local_http.rstrip('/')}/health/live", r.local_grpc, env, client_tls(r))


def _serving_tls_env(r: RolloutSettings) -> dict[str, str]:
    """The local server's TLS settings from the platform's: its certificate, and with a client certificate
    configured for the clients, mutual TLS against the clients' CA (one local CA signs both sides)."""
    if r.local_tls_cert_file is None or r.local_tls_key_file is None:
        return {}
    env = {
        "SLUICEGATE_SERVING__TLS_CERT_FILE": str(r.local_tls_cert_file),
        "SLUICEGATE_SERVING__TLS_KEY_FILE": str(r.local_tls_key_file),
    }
    if r.tls_client_cert_file is not None and r.tls_ca_file is not None:
        env["SLUICEGATE_SERVING__TLS_CLIENT_CA_FILE"] = str(r.tls_ca_file)
    return env


def _bridge_part(settings: Settings) -> Part:
    return Part(
        "bridge",
        [sys.executable, "-m", "sluicegate.app.cli", "bridge"],
        f"http://{LOOPBACK}:{settings.events.webhook_port}/health",
        f"http://{LOOPBACK}:{settings.events.webhook_port}/events",
    )


def _runner_part(settings: Settings) -> Part:
    return Part(
        "runner",
        [sys.executable, "-m", "flows.deployments"],
        f"http://{LOOPBACK}:{settings.prefect.runner_port}/health",
        "dataset-pipeline, scheduled-retrain",
        # The poll interval and the run limit travel in the settings (Prefect's own poll setting takes
        # whole seconds only).
        {
            "PREFECT_RUNNER_SERVER_ENABLE": "true",
            "PREFECT_RUNNER_SERVER_HOST": LOOPBACK,
            "PREFECT_RUNNER_SERVER_PORT": str(settings.prefect.runner_port),
        },
    )


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
