"""The Kubernetes manifests of the canary rollout (infra/k8s) as the tests read them: each overlay built
with `kubectl kustomize` (kubectl with kustomize v5 is required: the tests fail, never skip, without it),
and accessors for the objects the tests look at (the two tracks' Deployments, the server container, its
effective environment)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
OVERLAYS = ("plain", "istio", "mig")

NAMESPACE = "sluicegate-serving"
MODEL = "pcb-classifier"
TRACKS = ("stable", "canary")
INSTALL_KUBECTL = (
    "kubectl {need} is needed to build the kustomize overlays in infra/k8s: install kubectl 1.27 or newer "
    "(it bundles kustomize v5), e.g. from the Kubernetes apt repository (https://pkgs.k8s.io, package "
    "kubectl) or the Google Cloud SDK's apt repository (package kubectl); Debian's own kubernetes-client "
    "package is 1.20, whose kustomize is too old."
)


@cache
def kubectl() -> str:
    """kubectl, with a kustomize v5 inside; the test fails (never skips) without it."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(INSTALL_KUBECTL.format(need="(not found on PATH)"))
    out = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True, check=True)
    kustomize = json.loads(out.stdout).get("kustomizeVersion", "")
    match = re.match(r"v(\d+)\.", kustomize)
    if match is None or int(match[1]) < 5:
        pytest.fail(INSTALL_KUBECTL.format(need=f"with kustomize v5 (found {kustomize or 'none'})"))
    return path


@cache
def kustomize_output(overlay: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return result.stdout


def build(overlay: str) -> list[Obj]:
    """The overlay's objects (a fresh copy each call, so a test may change them)."""
    docs = [doc for doc in yaml.safe_load_all(kustomize_output(overlay)) if doc is not None]
    assert docs, f"overlay {overlay} built nothing"
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def manifest_files() -> list[Path]:
    """Every resource file kept in infra/k8s (kustomization.yaml files are build instructions)."""
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    assert files, f"no manifests under {K8S}"
    return files


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def deployments(objects: list[Obj]) -> dict[str, Obj]:
    """track -> Deployment."""
    return {track: one(objects, "Deployment", f"{MODEL}-{track}") for track in TRACKS}


def server(deployment: Obj) -> Obj:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server"], "one container, named server"
    container: Obj = containers[0]
    return container


def all_containers(objects: list[Obj]) -> Iterator[tuple[str, Obj]]:
    for deployment in of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment["metadata"]["name"], container


def serving_env(objects: list[Obj], deployment: Obj) -> dict[str, str]:
    """The container's plain env values, ConfigMaps (envFrom) first, then env on top."""
    container = server(deployment)
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = one(objects, "ConfigMap", source["configMapRef"]["name"])
        values.update(config_map["data"])
    values.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    return values
