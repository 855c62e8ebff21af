"""The Docker Compose stack (docker/compose.yaml), without a Docker engine: the file is valid against the
Compose Specification, its structure holds (dependencies, health checks, loopback ports, mounted and built
files), and its settings agree with the code it runs: every SLUICEGATE_* variable is a real setting and
each service's environment loads into the settings pointing at the other services by name. The
third-party services' own configuration is in test_compose_services.py, the worker image in
test_worker_image.py."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import BaseModel

from serving.server import parse_args
from serving.settings import ServingSettings
from sluicegate import storage
from sluicegate.settings import Settings
from tests.infra.compose_file import (
    COMPOSE,
    COMPOSE_GPU,
    DOCKER,
    ONE_SHOT,
    PLATFORM,
    ROOT,
    WORKER_DOCKERFILE,
    bind_mounts,
    command,
    environment,
    host_port,
    interpolate,
    load,
    option,
    published,
    services,
)

SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
# check-jsonschema 0.39.0's vendor/sha256/compose-spec.sha256 (tests/infra/schemas/README.md).
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"


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
    # One server per model, as one Deployment per model on Kubernetes: compose serves the PCB sample's.
    assert serving.repository == "models:/pcb-classifier@champion"
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
