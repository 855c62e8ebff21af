"""The Docker Compose stack (docker/compose.yaml) and the worker image, without a Docker engine: the file is
valid against the Compose Specification, and its wiring agrees with the code it runs. Every SLUICEGATE_*
variable is a real setting and each service's environment loads into the settings pointing at the other
services by name; the webhook MinIO calls is the bridge's (a MinIO-shaped delivery goes through the real
bridge app with MinIO's header); the Prefect, MLflow, Prometheus and Grafana configuration is checked by
their own code or tools; every mounted or built file exists and passes the build's .dockerignore."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from jsonschema import Draft202012Validator
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pydantic import BaseModel

from flows.events.records import S3ObjectEvent
from serving.server import parse_args
from serving.settings import ServingSettings
from sluicegate import storage
from sluicegate.settings import Settings
from tests.fixtures.services import free_port
from tests.infra.test_prometheus_rules import tool
from tests.infra.test_serving_image import hadolint

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
WORKER_DOCKERFILE = DOCKER / "worker.Dockerfile"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
# check-jsonschema 0.39.0's vendor/sha256/compose-spec.sha256 (tests/infra/schemas/README.md).
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
# Services that run once and exit; every other one is long-running.
ONE_SHOT = {"migrate", "prefect-deploy", "minio-init"}
# Services that run sluicegate code and so share the platform's settings.
PLATFORM = ("migrate", "prefect-deploy", "prefect-worker", "bridge", "mlflow", "serving")
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


# -- reading the compose file the way compose does -------------------------------------------------------


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $$)."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, default = match.group(2), match.group(3) or ""
        present = name in env and (env[name] != "" or op not in (":-", ":?"))
        if present:
            return env[name]
        if op in (":-", "-"):
            return default
        raise AssertionError(f"${{{name}}} has no default: `docker compose up` without a .env would fail")

    return _VARIABLE.sub(substitute, value)


def load(path: Path = COMPOSE, env: dict[str, str] | None = None) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict)
    result: dict[str, Any] = interpolate(document, env or {})
    return result


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {str(key): str(value) for key, value in raw.items()}


def command(service: dict[str, Any]) -> list[str]:
    raw = service.get("command", [])
    return shlex.split(raw) if isinstance(raw, str) else [str(part) for part in raw]


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    assert parts.hostname and parts.port, f"{url} names no host and port"
    return parts.hostname, parts.port


def published(service: dict[str, Any]) -> set[int]:
    """Container ports a service publishes (short syntax, as this file writes them)."""
    return {int(str(port).rsplit(":", 1)[-1].split("/")[0]) for port in service.get("ports", [])}


def option(argv: Sequence[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
    for index, arg in enumerate(argv):
        if arg == name:
            return argv[index + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {argv}")


@pytest.fixture
def platform_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Sets a service's environment (and only it) as the process environment, then builds Settings."""

    def apply(env: dict[str, str]) -> Settings:
        for name in list(os.environ):
            if name.startswith(("SLUICEGATE_", "PREFECT_", "MLFLOW_", "AWS_")):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return Settings()

    yield apply


# -- the Compose Specification ---------------------------------------------------------------------------


def validator() -> Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def test_the_schema_is_the_vendored_upstream_file() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256
    assert json.loads(SCHEMA.read_text())["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_specification(path: Path) -> None:
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(load(path))]
    assert errors == []


@pytest.mark.parametrize(
    ("where", "mutation"),
    [
        ("a misspelt service key", lambda c: c["services"]["bridge"].update(depends_no={})),
        (
            "an unknown depends_on condition",
            lambda c: c["services"]["bridge"]["depends_on"]["migrate"].update(condition="service_ready"),
        ),
        ("an unknown healthcheck key", lambda c: c["services"]["postgres"]["healthcheck"].update(period="5s")),
        ("a port that is a mapping of nonsense", lambda c: c["services"]["grafana"].update(ports=[{"bogus": 1}])),
    ],
)
def test_the_schema_catches_mistakes(compose: dict[str, Any], where: str, mutation: Any) -> None:
    broken = json.loads(json.dumps(compose))
    mutation(broken)
    assert list(validator().iter_errors(broken)), f"{where} passed the schema"


# -- structure: dependencies, health, ports, files -------------------------------------------------------


def test_every_dependency_names_a_service_and_the_graph_has_no_cycle(compose: dict[str, Any]) -> None:
    table = services(compose)
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in visiting, f"dependency cycle: {' -> '.join((*path, name))}"
        if name in order:
            return
        visiting.add(name)
        for dependency, rule in table[name].get("depends_on", {}).items():
            assert dependency in table, f"{name} depends on {dependency!r}, which is no service"
            condition = rule["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in table[dependency], f"{name} waits for {dependency} to be healthy: no check"
            if condition == "service_completed_successfully":
                assert dependency in ONE_SHOT, f"{name} waits for long-running {dependency} to complete"
            visit(dependency, (*path, name))
        visiting.discard(name)
        order.append(name)

    for name in table:
        visit(name, ())
    # The order compose starts things in: each client after what it talks to.
    assert order.index("migrate") < order.index("bridge") < order.index("minio") < order.index("minio-init")
    assert order.index("minio-init") < order.index("mlflow") < order.index("prefect-worker")
    assert order.index("prefect-deploy") < order.index("prefect-worker")


def test_long_running_services_have_health_checks_and_restart(compose: dict[str, Any]) -> None:
    for name, service in services(compose).items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", name
            continue
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        assert service.get("restart") == "unless-stopped", name


def test_ports_are_published_on_loopback_only(compose: dict[str, Any]) -> None:
    seen: set[str] = set()
    for name, service in services(compose).items():
        for port in service.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port!r} beyond loopback"
            host = port.split(":")[1]
            assert host not in seen, f"host port {host} published twice"
            seen.add(host)
    assert {"4200", "5000", "9000", "9001", "9102", "8001", "8000", "9090", "9093", "3000", "5432"} <= seen


def bind_mounts(compose: dict[str, Any]) -> Iterator[tuple[str, Path, str]]:
    for name, service in services(compose).items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                yield name, (DOCKER / source).resolve(), target


def test_mounted_and_built_files_exist_and_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    mounts = list(bind_mounts(compose))
    assert len(mounts) >= 7
    for name, source, target in mounts:
        assert source.exists(), f"{name} mounts {source}, which does not exist"
        assert source.is_relative_to(ROOT), f"{name} mounts {source} from outside the repository"
        assert target.startswith("/")
    declared = set(compose["volumes"])
    used = set()
    for name, service in services(compose).items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} uses undeclared volume {source}"
                used.add(source)
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert context == ROOT, f"{name} builds from {context}"
            assert (context / service["build"]["dockerfile"]).is_file(), name
    assert used == declared, f"declared but unused: {declared - used}"


# -- settings: the same values everywhere, pointing at the services by name -----------------------------


def sluicegate_variables(compose: dict[str, Any]) -> dict[str, set[str]]:
    """Every SLUICEGATE_* name -> the services that set it (the Dockerfile's ENV under 'worker image')."""
    found: dict[str, set[str]] = {}
    for name, service in services(compose).items():
        for variable in environment(service):
            if variable.startswith("SLUICEGATE_"):
                found.setdefault(variable, set()).add(name)
    for variable in re.findall(r"\b(SLUICEGATE_[A-Z0-9_]+)=", WORKER_DOCKERFILE.read_text()):
        found.setdefault(variable, set()).add("worker image")
    return found


def test_every_sluicegate_variable_is_a_setting(compose: dict[str, Any]) -> None:
    """Checked by name: pydantic-settings ignores an unknown top-level SLUICEGATE_X without a word."""
    found = sluicegate_variables(compose)
    assert len(found) >= 20
    for variable in found:
        rest = variable.removeprefix("SLUICEGATE_")
        if rest.startswith("SERVING__"):
            field = rest.removeprefix("SERVING__").lower()
            assert field in ServingSettings.model_fields, f"{variable} is no serving setting"
            continue
        group, _, field = rest.lower().partition("__")
        assert group in Settings.model_fields, f"{variable}: no setting {group!r} (set by {found[variable]})"
        if field:
            annotation = Settings.model_fields[group].annotation
            assert isinstance(annotation, type) and issubclass(annotation, BaseModel), variable
            assert field in annotation.model_fields, f"{variable}: {group} has no {field!r} (set by {found[variable]})"


def test_the_platform_services_share_one_environment(compose: dict[str, Any]) -> None:
    shared = {
        name: {
            k: v for k, v in environment(services(compose)[name]).items() if not k.startswith("SLUICEGATE_SERVING__")
        }
        for name in PLATFORM
    }
    anchor = interpolate(yaml.safe_load(COMPOSE.read_text())["x-sluicegate-env"], {})
    for name, env in shared.items():
        mismatched = {k: (env.get(k), v) for k, v in anchor.items() if env.get(k) != v}
        assert mismatched == {}, f"{name} differs from x-sluicegate-env: {mismatched}"


@pytest.mark.parametrize("service", PLATFORM)
def test_each_platform_service_loads_settings_that_name_the_services(
    compose: dict[str, Any], platform_env: Any, service: str
) -> None:
    table = services(compose)
    env = environment(table[service])
    settings: Settings = platform_env(env)
    postgres = environment(table["postgres"])
    minio = environment(table["minio"])

    assert host_port(settings.storage.url) == ("minio", 9000) and 9000 in published(table["minio"])
    assert settings.storage.access_key_id and settings.storage.secret_access_key
    assert settings.storage.access_key_id.get_secret_value() == minio["MINIO_ROOT_USER"]
    assert settings.storage.secret_access_key.get_secret_value() == minio["MINIO_ROOT_PASSWORD"]
    assert host_port(settings.prefect.url) == ("prefect-server", 4200)
    assert urlsplit(settings.prefect.url).path == "/api"
    assert str(host_port(settings.prefect.url)[1]) == option(command(table["prefect-server"]), "--port")
    assert host_port(settings.mlflow.url) == ("mlflow", int(option(command(table["mlflow"]), "--port")))
    metadata = urlsplit(settings.metadata_url)
    assert metadata.scheme == "postgresql+psycopg" and (metadata.hostname, metadata.port) == ("postgres", 5432)
    assert (metadata.username, metadata.password) == (postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"])
    assert metadata.path == f"/{postgres['POSTGRES_DB']}"
    assert settings.events.sources == ["webhook"], "MinIO has no SQS queue: the bridge would fail polling one"
    serving = ServingSettings(**parse_args(command(table["serving"])))
    assert settings.rollout.local_grpc == f"serving:{serving.grpc_port}"
    assert settings.rollout.local_http == f"http://serving:{serving.http_port}"
    assert settings.rollout.alertmanager_url and host_port(settings.rollout.alertmanager_url) == ("alertmanager", 9093)
    assert str(settings.home) == "/var/lib/sluicegate"
    # What `sluicegate up` gives its parts (stack.child_env): the same endpoints for the libraries' own clients.
    assert {k: env[k] for k in storage.credentials_env(settings)} == storage.credentials_env(settings)
    assert env["PREFECT_API_URL"] == settings.prefect.url and env["MLFLOW_TRACKING_URI"] == settings.mlflow.url


def test_every_url_in_the_file_names_a_service_or_the_host_loopback(compose: dict[str, Any]) -> None:
    table = services(compose)
    text = json.dumps(compose)
    urls = set(re.findall(r"\b(?:https?|postgresql\+\w+|s3)://[^\s\"',]+", text))
    assert len(urls) >= 10
    for url in urls:
        host = urlsplit(url).hostname
        if url.startswith("s3://"):
            continue  # a bucket, not a host
        assert host in table or host == "127.0.0.1", f"{url}: {host} is no service"


def test_the_model_server_reads_the_same_registry_store_and_token(compose: dict[str, Any], platform_env: Any) -> None:
    table = services(compose)
    env = environment(table["serving"])
    settings: Settings = platform_env(env)
    serving = ServingSettings(**parse_args(command(table["serving"])))
    assert serving.host == "0.0.0.0"  # inside the container; published on 127.0.0.1
    assert serving.repository == f"models:/{settings.model.name}@champion"
    assert serving.mlflow_tracking_uri == settings.mlflow.url
    assert serving.s3_endpoint_url == settings.storage.endpoint_url
    assert serving.admin_token and settings.rollout.admin_token
    assert serving.admin_token.get_secret_value() == settings.rollout.admin_token.get_secret_value()
    assert {serving.grpc_port, serving.http_port} <= published(table["serving"])
    assert f":{serving.http_port}/health/ready" in " ".join(table["serving"]["healthcheck"]["test"])
    assert "tensorrt" not in serving.runtime_order, "CPU by default; compose.gpu.yaml adds TensorRT"
    gpu = environment(load(COMPOSE_GPU)["services"]["serving"])
    assert json.loads(gpu["SLUICEGATE_SERVING__RUNTIME_ORDER"])[0] == "tensorrt"
    # The canary's folder: the rollout writes where the server may be pointed.
    mounts = {v.split(":")[0]: v.split(":")[1] for v in table["serving"]["volumes"]}
    worker = {v.split(":")[0]: v.split(":")[1] for v in table["prefect-worker"]["volumes"]}
    assert mounts["serving-repo"] == worker["serving-repo"] == str(settings.rollout.local_repository)


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


# -- the worker image ------------------------------------------------------------------------------------


def test_the_worker_dockerfile_lints_clean() -> None:
    result = subprocess.run([hadolint(), "--format", "json", str(WORKER_DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


def test_the_worker_image_is_non_root_on_the_cpu_torch_of_the_makefile() -> None:
    text = WORKER_DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("0", "root"))
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim\S*$", text, flags=re.M)
    torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert torch and f"ARG TORCH_VERSION={torch.group(1)}\n" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    torch_line = text.index('"torch==${TORCH_VERSION}"')
    assert torch_line < text.index("-r requirements.txt") < text.index("--no-deps .")
    assert "pip check" in text


def copy_sources(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources: list[str] = []
    for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M):
        parts = [part for part in line.split() if not part.startswith("--")]
        sources += parts[:-1]
    return sources


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns these files use: the last matching line wins; a path is
    excluded with its parent; `*` does not cross `/`; `**/` matches at any depth."""

    def matches(candidate: str, pattern: str) -> bool:
        if pattern.startswith("**/"):
            parts = candidate.split("/")
            return any(matches("/".join(parts[i:]), pattern[3:]) for i in range(len(parts)))
        a, b = candidate.split("/"), pattern.split("/")
        return len(a) == len(b) and all(fnmatchcase(x, y) for x, y in zip(a, b, strict=True))

    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if any(matches(prefix, pattern) for prefix in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", ["worker.Dockerfile", "serving.Dockerfile"])
def test_copy_sources_exist_and_pass_the_dockerignore(name: str) -> None:
    dockerfile = DOCKER / name
    patterns = [
        line.strip()
        for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = copy_sources(dockerfile)
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
        assert not ignored(source, patterns), f"{name} copies {source}, which its .dockerignore leaves out"
        inner = next((ROOT / source).rglob("*.py"), None) if (ROOT / source).is_dir() else None
        if inner is not None:
            assert not ignored(str(inner.relative_to(ROOT)), patterns), f"{inner} is left out of the context"
    # The filter is live: the venv and the tests never reach the daemon.
    for path in (".venv/bin/python", "tests/infra/test_compose.py", ".git/HEAD", "serving/__pycache__/x.pyc"):
        assert ignored(path, patterns), f"{name}'s context would include {path}"


def pinned() -> dict[str, str]:
    lines = (DOCKER / "worker-requirements.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pins}


def test_worker_requirements_pin_every_runtime_dependency_within_its_range() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pinned()
    assert "torch" not in pins, "torch comes from the CPU index, before the requirements"
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} (pyproject) is not pinned in docker/worker-requirements.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {requirement}"
        for extra in requirement.extras:  # e.g. moto[server], psycopg[binary]: the extra's packages too
            from importlib.metadata import requires

            for dependency in requires(requirement.name) or []:
                dep = Requirement(dependency)
                if dep.marker and dep.marker.evaluate({"extra": extra}) and not dep.marker.evaluate({"extra": ""}):
                    assert canonicalize_name(dep.name) in pins, f"{dep.name} ({requirement.name}[{extra}])"
