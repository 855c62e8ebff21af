"""The third-party services of the Docker Compose stack (docker/compose.yaml), checked by their own code
or tools: MinIO notifies the bridge (a MinIO-shaped delivery goes through the real bridge app with
MinIO's header), the PREFECT_* variables are Prefect settings, MLflow's stores and allowed hosts,
PostgreSQL's databases, `promtool check config` on the Prometheus file and Grafana's provisioning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from flows.events.records import S3ObjectEvent
from serving.server import parse_args
from serving.settings import ServingSettings
from sluicegate.settings import Settings
from tests.fixtures.services import free_port
from tests.infra.compose_file import (
    ROOT,
    WORKER_DOCKERFILE,
    bind_mounts,
    command,
    environment,
    host_port,
    load,
    option,
    pinned,
    published,
    services,
)
from tests.infra.test_prometheus_rules import tool

# -- events: MinIO -> bridge -> the Prefect trigger ------------------------------------------------------


def test_minio_notifies_the_bridge_on_the_settings_port_and_filter(compose: dict[str, Any], platform_env: Any) -> None:
    table = services(compose)
    minio = environment(table["minio"])
    settings: Settings = platform_env(environment(table["bridge"]))
    ids = {
        k.removeprefix("MINIO_NOTIFY_WEBHOOK_ENDPOINT_")
        for k in minio
        if k.startswith("MINIO_NOTIFY_WEBHOOK_ENDPOINT_")
    }
    assert len(ids) == 1
    (target,) = ids
    assert minio[f"MINIO_NOTIFY_WEBHOOK_ENABLE_{target}"] == "on"
    endpoint = urlsplit(minio[f"MINIO_NOTIFY_WEBHOOK_ENDPOINT_{target}"])
    assert (endpoint.hostname, endpoint.port, endpoint.path) == ("bridge", settings.events.webhook_port, "/events")
    assert settings.events.webhook_port in published(table["bridge"])
    assert f":{settings.events.webhook_port}/health" in " ".join(table["bridge"]["healthcheck"]["test"])
    queue = minio[f"MINIO_NOTIFY_WEBHOOK_QUEUE_DIR_{target}"]
    assert any(v.endswith(f":{queue}") for v in table["minio"]["volumes"]), "the event queue is not on a volume"

    script = command(table["minio-init"])[-1]
    bucket = f"local/{settings.storage.bucket}"
    assert f"mc mb --ignore-existing {bucket}" in script
    assert f"mc version enable {bucket}" in script
    add = next(line.split() for line in script.splitlines() if "mc event add" in line)
    assert add[3:5] == [bucket, f"arn:minio:sqs::{target}:webhook"]
    assert option(add, "--event") == "put"
    assert option(add, "--prefix") == settings.storage.datasets_prefix
    assert option(add, "--suffix") == settings.events.notification_suffix
    assert table["minio-init"]["environment"]["MC_HOST_local"].endswith("@minio:9000")


def test_the_bridge_binds_all_container_interfaces() -> None:
    """MinIO reaches the webhook over the compose network: the bridge binds the container's interfaces."""
    service = load()["services"]["bridge"]
    assert command(service) == ["sluicegate", "bridge"]
    with pytest.MonkeyPatch.context() as patch:
        for name, value in service["environment"].items():
            patch.setenv(name, str(value))
        assert Settings().events.webhook_host == "0.0.0.0"
    assert Settings().events.webhook_host == "127.0.0.1"  # the default stays loopback


class RecordingSink:
    """An EventSink that keeps what it is handed instead of POSTing it to Prefect."""

    def __init__(self) -> None:
        self.events: list[S3ObjectEvent] = []

    def emit(self, events: Sequence[S3ObjectEvent]) -> None:
        self.events.extend(events)


def minio_delivery(bucket: str, key: str) -> str:
    """One notification as MinIO's webhook target POSTs it: EventName, Key and the S3 record."""
    record = {
        "eventVersion": "2.0",
        "eventSource": "minio:s3",
        "awsRegion": "",
        "eventTime": "2026-11-29T10:00:00.000Z",
        "eventName": "s3:ObjectCreated:Put",
        "s3": {
            "s3SchemaVersion": "1.0",
            "configurationId": "Config",
            "bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
            "object": {
                "key": key.replace("/", "%2F"),
                "size": 120,
                "eTag": "5d41402abc4b2a76b9719d911017c592",
                "versionId": "0b7e9d3a-1c2f-4e8b-9a6d-2f1e3c4b5a69",
                "sequencer": "1876B0C9A1D2E3F4",
            },
        },
    }
    return json.dumps({"EventName": "s3:ObjectCreated:Put", "Key": f"{bucket}/{key}", "Records": [record]})


def test_a_minio_delivery_reaches_the_trigger_through_the_bridge(
    compose: dict[str, Any], platform_env: Any, tmp_path: Path
) -> None:
    """The real bridge app, on the compose settings, behind the URL and token MinIO is given."""
    import uvicorn

    from flows.events.bridge import Bridge
    from flows.events.webhook import webhook_app
    from sluicegate.metadata import MetadataStore

    table = services(compose)
    minio = environment(table["minio"])
    settings: Settings = platform_env(environment(table["bridge"]))
    token = minio["MINIO_NOTIFY_WEBHOOK_AUTH_TOKEN_SLUICEGATE"]
    path = urlsplit(minio["MINIO_NOTIFY_WEBHOOK_ENDPOINT_SLUICEGATE"]).path
    assert settings.events.webhook_token and settings.events.webhook_token.get_secret_value() == token

    store = MetadataStore(f"sqlite:///{tmp_path / 'metadata.db'}")
    store.upgrade()
    sink = RecordingSink()
    app = webhook_app(Bridge(store, sink), settings.events.webhook_token.get_secret_value(), [])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        key = f"{settings.storage.datasets_prefix}pcb/2026-11-29/{settings.events.notification_suffix}"
        body = minio_delivery(settings.storage.bucket, key)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.post(path, content=body).status_code == 401
            # MinIO's webhook target sends a one-word auth token as "Bearer <token>".
            ok = client.post(path, content=body, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["emitted"] == 1, ok.text
    finally:
        server.should_exit = True
        thread.join(10)
        store.dispose()
    (event,) = sink.events
    assert (event.bucket, event.key, event.version_id) == (
        settings.storage.bucket,
        key,
        "0b7e9d3a-1c2f-4e8b-9a6d-2f1e3c4b5a69",
    )
    # prefect.yaml's trigger selects exactly these labels.
    trigger = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]["triggers"][0]
    labels = event.resource()
    assert labels["s3.object.name"] == trigger["match"]["s3.object.name"]
    assert fnmatchcase(labels["prefect.resource.id"], trigger["match"]["prefect.resource.id"])


# -- Prefect ---------------------------------------------------------------------------------------------


def prefect_names() -> set[str]:
    # Prefect's own list of the variable names it reads (private, but the one authority on them).
    from prefect.settings.legacy import _get_valid_setting_names
    from prefect.settings.models.root import Settings as PrefectSettings

    return set(_get_valid_setting_names(PrefectSettings))


def init_databases() -> set[str]:
    text = (ROOT / "infra" / "postgres" / "init.sql").read_text()
    return set(re.findall(r"^CREATE DATABASE (\w+);", text, flags=re.M))


def test_prefect_variables_are_prefect_settings_and_the_server_uses_its_database(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = services(compose)
    known = prefect_names()
    for name, service in table.items():
        for variable in environment(service):
            if variable.startswith("PREFECT_"):
                assert variable in known, f"{name}: {variable} is no Prefect setting"
    env = environment(table["prefect-server"])
    for variable in [v for v in os.environ if v.startswith("PREFECT_")]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    from prefect.settings.models.root import Settings as PrefectSettings

    server = PrefectSettings().server
    url = urlsplit(server.database.connection_url.get_secret_value())  # type: ignore[union-attr]
    assert url.scheme == "postgresql+asyncpg" and (url.hostname, url.port) == ("postgres", 5432)
    assert url.path.lstrip("/") in init_databases()
    assert server.ui.api_url == "http://127.0.0.1:4200/api" and 4200 in published(table["prefect-server"])


def test_the_work_pool_and_deployments_are_prefect_yamls(compose: dict[str, Any]) -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    pools = {deployment["work_pool"]["name"] for deployment in spec["deployments"]}
    assert pools == {"sluicegate"}
    table = services(compose)
    worker = command(table["prefect-worker"])
    assert worker[:3] == ["prefect", "worker", "start"]
    assert option(worker, "--pool") == "sluicegate" and option(worker, "--type") == "process"
    script = command(table["prefect-deploy"])[-1]
    assert "prefect work-pool inspect sluicegate" in script
    assert "prefect work-pool create sluicegate --type process" in script
    assert "prefect --no-prompt deploy --all" in script
    # The pull step's directory is where the image keeps the code (and prefect.yaml).
    pull = spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
    assert re.search(rf"^WORKDIR {re.escape(pull)}$", WORKER_DOCKERFILE.read_text(), flags=re.M)
    assert "COPY pyproject.toml README.md prefect.yaml ./" in WORKER_DOCKERFILE.read_text()
    assert pinned()["prefect"] == spec["prefect-version"]


# -- MLflow ----------------------------------------------------------------------------------------------


def test_mlflow_stores_in_postgres_and_minio_and_answers_its_clients(
    compose: dict[str, Any], platform_env: Any
) -> None:
    from mlflow.server.security_utils import is_allowed_host_header

    table = services(compose)
    argv = command(table["mlflow"])
    env = environment(table["mlflow"])
    settings: Settings = platform_env(env)
    backend = urlsplit(option(argv, "--backend-store-uri"))
    assert backend.scheme == "postgresql+psycopg" and backend.hostname == "postgres"
    assert backend.path.lstrip("/") in init_databases()
    prefix = settings.mlflow.artifacts_prefix.strip("/")
    assert option(argv, "--artifacts-destination") == f"s3://{settings.storage.bucket}/{prefix}"
    assert env["MLFLOW_S3_ENDPOINT_URL"] == settings.storage.endpoint_url
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and option(argv, "--workers") == "1"
    allowed = env["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert is_allowed_host_header(allowed, urlsplit(settings.mlflow.url).netloc)  # the containers
    assert is_allowed_host_header(allowed, "127.0.0.1:5000") and is_allowed_host_header(allowed, "localhost:5000")
    assert not is_allowed_host_header(allowed, "evil.example.com")


def test_postgres_creates_every_database_the_services_use(compose: dict[str, Any]) -> None:
    table = services(compose)
    mounts = {
        str(source.relative_to(ROOT)): target for name, source, target in bind_mounts(compose) if name == "postgres"
    }
    assert mounts["infra/postgres/init.sql"].startswith("/docker-entrypoint-initdb.d/")
    assert init_databases() == {"mlflow", "prefect"}
    assert environment(table["postgres"])["POSTGRES_DB"] not in init_databases()


# -- Prometheus, Alertmanager, Grafana -------------------------------------------------------------------


def container_path(compose: dict[str, Any], service: str, relative: str) -> str:
    for name, source, target in bind_mounts(compose):
        if name == service and source == (ROOT / relative).resolve():
            return target
    raise AssertionError(f"{service} does not mount {relative}")


def test_prometheus_config_checks_and_scrapes_the_model_server(compose: dict[str, Any]) -> None:
    table = services(compose)
    config_file = ROOT / "infra" / "prometheus" / "prometheus-compose.yml"
    result = subprocess.run(
        [tool("promtool", "prometheus"), "check", "config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr
    target = container_path(compose, "prometheus", "infra/prometheus/prometheus-compose.yml")
    assert option(command(table["prometheus"]), "--config.file") == target
    # The rule glob is relative to the config file: the rules folder is mounted beside it.
    config = yaml.safe_load(config_file.read_text())
    (rules,) = config["rule_files"]
    rules_dir = container_path(compose, "prometheus", "infra/prometheus/rules")
    assert str(PurePosixPath(target).parent / PurePosixPath(rules).parent) == rules_dir
    serving = ServingSettings(**parse_args(command(table["serving"])))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (static,) = jobs["sluicegate-serving"]["static_configs"]
    assert static["targets"] == [f"serving:{serving.http_port}"]
    assert jobs["sluicegate-serving"]["metrics_path"] == "/metrics"
    (alerting,) = config["alerting"]["alertmanagers"][0]["static_configs"]
    assert alerting["targets"] == ["alertmanager:9093"] and 9093 in published(table["alertmanager"])
    alertmanager = command(table["alertmanager"])
    assert option(alertmanager, "--config.file") == container_path(
        compose, "alertmanager", "infra/alertmanager/alertmanager.yml"
    )


def test_grafana_provisions_the_datasource_and_the_dashboard(compose: dict[str, Any]) -> None:
    provisioning = ROOT / "infra" / "grafana" / "provisioning"
    assert container_path(compose, "grafana", "infra/grafana/provisioning/datasources").endswith("/datasources")
    assert container_path(compose, "grafana", "infra/grafana/provisioning/dashboards").endswith("/dashboards")
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert host_port(datasource["url"]) == ("prometheus", 9090) and 9090 in published(services(compose)["prometheus"])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "sluicegate.yml").read_text())["providers"]
    dashboard = container_path(compose, "grafana", "infra/grafana/sluicegate-serving.json")
    assert str(PurePosixPath(dashboard).parent) == provider["options"]["path"]
    home = environment(services(compose)["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == dashboard
    variables = json.loads((ROOT / "infra" / "grafana" / "sluicegate-serving.json").read_text())["templating"]["list"]
    assert {"type": "datasource", "query": "prometheus"}.items() <= variables[0].items()
