"""docker/compose.yaml read the way compose does (variable substitution included), and the small
accessors the compose and worker-image tests share: a service's environment, command line, published
ports and bind mounts, and the worker image's pinned requirements."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
WORKER_DOCKERFILE = DOCKER / "worker.Dockerfile"
# Services that run once and exit; every other one is long-running.
ONE_SHOT = {"migrate", "prefect-deploy", "minio-init"}
# Services that run sluicegate code and so share the platform's settings.
PLATFORM = ("migrate", "prefect-deploy", "prefect-worker", "bridge", "mlflow", "serving")
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


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


def bind_mounts(compose: dict[str, Any]) -> Iterator[tuple[str, Path, str]]:
    for name, service in services(compose).items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                yield name, (DOCKER / source).resolve(), target


def pinned() -> dict[str, str]:
    lines = (DOCKER / "worker-requirements.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pins}
