"""Kubernetes manifests of the canary rollout (infra/k8s), validated: every stack (a shared overlay and
two models' overlays) builds with `kubectl kustomize`, and every built object and every manifest file
validates against the Kubernetes OpenAPI schema in strict mode (an unknown field fails) or, for the
CRDs, against the schemas in tests/infra/schemas. What the objects must say is in test_k8s_pods.py,
test_k8s_routing.py and test_k8s_models.py."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.infra.k8s_manifests import K8S, MODELS, STACKS, Obj, build, deployments, manifest_files, one, server

MODEL = MODELS[0]
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The oldest Kubernetes the manifests target (tcp_fin_timeout is a safe sysctl from 1.29, the preStop
# sleep action is on by default from 1.30) and the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
CRD_SCHEMAS = {
    ("networking.istio.io/v1", "DestinationRule"): "destinationrule.json",
    ("networking.istio.io/v1", "VirtualService"): "virtualservice.json",
    ("security.istio.io/v1", "PeerAuthentication"): "peerauthentication.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
}


# --- schema validation ------------------------------------------------------------------------------


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_errors(obj: Obj) -> list[str]:
    """Why obj is not valid: the CRD schema kept here, else the Kubernetes OpenAPI schema (strict) of
    every version in K8S_VERSIONS. Empty when valid."""
    label = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CRD_SCHEMAS:
        return [
            f"{label} ({key[0]}): {'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(*key).iter_errors(obj)
        ]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{label} (Kubernetes {version}): {'/'.join(map(str, e.absolute_path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{label}: {e.message} (a CRD? keep a schema for it in {SCHEMAS} and CRD_SCHEMAS)")
    return errors


@pytest.mark.parametrize("stack", STACKS)
def test_every_built_object_is_valid(stack: str) -> None:
    errors = [error for obj in build(stack) for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_valid(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no object"
    errors = [error for doc in docs for error in schema_errors(doc)]
    assert not errors, "\n".join(errors)


def _typo_in_probe(objects: list[Obj]) -> Obj:
    deployment = deployments(objects, MODEL)["stable"]
    server(deployment)["readinessProbe"]["initialDelay"] = 30  # initialDelaySeconds
    return deployment


def _typo_in_spec(objects: list[Obj]) -> Obj:
    deployment = deployments(objects, MODEL)["canary"]
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    return deployment


def _wrong_type(objects: list[Obj]) -> Obj:
    service = one(objects, "Service", MODEL)
    service["spec"]["ports"][0]["port"] = "8001"
    return service


def _typo_in_weight(objects: list[Obj]) -> Obj:
    virtual_service = one(objects, "VirtualService", MODEL)
    route = virtual_service["spec"]["http"][0]["route"][1]
    route["weightPercent"] = route.pop("weight")
    return virtual_service


def _typo_in_podmonitor(objects: list[Obj]) -> Obj:
    monitor = one(objects, "PodMonitor", MODEL)
    monitor["spec"]["podMetricsEndpoints"][0]["scrapeInterval"] = "15s"  # interval
    return monitor


def _typo_in_mtls_mode(objects: list[Obj]) -> Obj:
    peer_authentication = one(objects, "PeerAuthentication", MODEL)
    peer_authentication["spec"]["mtls"]["mode"] = "STRICTLY"
    return peer_authentication


def _crd_without_schema(objects: list[Obj]) -> Obj:
    virtual_service = one(objects, "VirtualService", MODEL)
    virtual_service["apiVersion"] = "networking.istio.io/v1beta1"
    return virtual_service


@pytest.mark.parametrize(
    ("breaks", "expected"),
    [
        (_typo_in_probe, r"initialDelay'"),
        (_typo_in_spec, r"replica\b"),
        (_wrong_type, r"'8001' is not of type 'integer'"),
        (_typo_in_weight, r"weightPercent"),
        (_typo_in_podmonitor, r"scrapeInterval"),
        (_typo_in_mtls_mode, r"'STRICTLY' is not one of"),
        (_crd_without_schema, r"Couldn't find schema for kind VirtualService"),
    ],
    ids=[
        "deployment-probe-typo",
        "deployment-spec-typo",
        "service-port-string",
        "vs-weight-typo",
        "podmonitor-typo",
        "peerauthentication-mode-typo",
        "crd-no-schema",
    ],
)
def test_validation_rejects_a_broken_object(breaks: Any, expected: str) -> None:
    broken = breaks(build("istio"))
    errors = schema_errors(broken)
    assert errors, f"the broken {broken['kind']} passed validation"
    assert any(re.search(expected, error) for error in errors), "\n".join(errors)


def test_kubernetes_validate_is_strict_only_when_asked() -> None:
    """The reason for strict=True: without it an unknown field passes."""
    deployment = _typo_in_probe(build("plain"))
    kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=False)
    with pytest.raises(kubernetes_validate.ValidationError, match="initialDelay'"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
