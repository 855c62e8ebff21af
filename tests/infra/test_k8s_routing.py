"""How traffic reaches the serving pods and who may move it, in the Kubernetes manifests (infra/k8s):
the Service selects both tracks, a disruption budget and an autoscaler cover stable, the rollout
controller's Role is least privilege, the Ingress terminates TLS and speaks gRPC, a PodMonitor scrapes
the metrics, and the Istio overlay splits by weight (the replica-ratio overlays have no Istio objects)."""

from __future__ import annotations

import re

import pytest

from tests.infra.k8s_manifests import (
    MODEL,
    NAMESPACE,
    OVERLAYS,
    TRACKS,
    build,
    deployments,
    kustomize_output,
    of_kind,
    one,
    server,
)

SERVICE_HOST = f"{MODEL}.{NAMESPACE}.svc.cluster.local"
# What the rollout controller may do: (apiGroup, resource) -> verbs. Anything more is a finding.
ROLLOUT_RULES = {
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "deployments/scale"): {"get", "patch"},
    ("apps", "replicasets"): {"get", "list"},
    ("", "services"): {"get", "list", "patch"},
}
ISTIO_RULES = {
    ("networking.istio.io", "destinationrules"): {"get", "list", "create", "patch"},
    ("networking.istio.io", "virtualservices"): {"get", "list", "create", "patch"},
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_selects_both_tracks(overlay: str) -> None:
    objects = build(overlay)
    service = one(objects, "Service", MODEL)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "http"}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"], ports["grpc"]["appProtocol"]) == (8001, "grpc", "grpc")
    assert (ports["http"]["port"], ports["http"]["targetPort"]) == (8000, "http")
    selector = service["spec"]["selector"]
    assert "sluicegate.io/track" not in selector
    for deployment in deployments(objects).values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert {p["targetPort"] for p in ports.values()} <= {p["name"] for p in server(deployment)["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budget_and_autoscaler_cover_stable(overlay: str) -> None:
    objects = build(overlay)
    stable = deployments(objects)["stable"]
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert len(budgets) == 1
    budget = budgets[0]["spec"]
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable") == 1
    assert budget["selector"]["matchLabels"] == stable["spec"]["selector"]["matchLabels"]
    hpa = one(objects, "HorizontalPodAutoscaler", f"{MODEL}-stable")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", f"{MODEL}-stable")
    assert hpa["spec"]["minReplicas"] >= 2, "a budget of one unavailable pod needs two to drain a node"
    assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
    containers = {c["name"] for c in stable["spec"]["template"]["spec"]["containers"]}
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "ContainerResource":
            assert metric["containerResource"]["container"] in containers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_role_is_least_privilege(overlay: str) -> None:
    objects = build(overlay)
    role = one(objects, "Role", "sluicegate-rollout")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for field in ("apiGroups", "resources", "verbs"):
            assert not any("*" in value for value in rule[field]), f"wildcard in {field}: {rule}"
        assert not any("secret" in resource for resource in rule["resources"]), f"secrets access: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    expected = ROLLOUT_RULES | (ISTIO_RULES if overlay == "istio" else {})
    assert granted == expected
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    binding = one(objects, "RoleBinding", "sluicegate-rollout")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sluicegate-rollout"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sluicegate-rollout", "namespace": NAMESPACE}]
    one(objects, "ServiceAccount", "sluicegate-rollout")
    for deployment in deployments(objects).values():
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] != "sluicegate-rollout"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_terminates_tls_and_speaks_grpc(overlay: str) -> None:
    ingress = one(build(overlay), "Ingress", MODEL)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    [tls] = ingress["spec"]["tls"]
    assert tls["secretName"]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] in tls["hosts"]
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": MODEL, "port": {"name": "grpc"}}
    if overlay == "istio":
        assert annotations["nginx.ingress.kubernetes.io/service-upstream"] == "true"
        assert annotations["nginx.ingress.kubernetes.io/upstream-vhost"] == SERVICE_HOST


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitor_scrapes_metrics_every_15s(overlay: str) -> None:
    objects = build(overlay)
    monitor = one(objects, "PodMonitor", MODEL)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for deployment in deployments(objects).values():
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert "prometheus.io/scrape" not in deployment["spec"]["template"]["metadata"].get("annotations", {})


def test_istio_splits_by_weight_with_all_traffic_on_stable() -> None:
    objects = build("istio")
    rule = one(objects, "DestinationRule", MODEL)
    assert rule["spec"]["host"] == SERVICE_HOST
    subsets = {s["name"]: s["labels"] for s in rule["spec"]["subsets"]}
    assert subsets == {track: {"sluicegate.io/track": track} for track in TRACKS}
    for track, deployment in deployments(objects).items():
        assert subsets[track].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    service = one(objects, "VirtualService", MODEL)
    assert service["spec"]["hosts"] == [SERVICE_HOST]
    [route] = service["spec"]["http"]
    weights = {r["destination"]["subset"]: r["weight"] for r in route["route"]}
    assert weights == {"stable": 100, "canary": 0}
    assert sum(weights.values()) == 100
    assert all(r["destination"]["host"] == SERVICE_HOST for r in route["route"])
    assert "grpc" in {p["name"] for p in one(objects, "Service", MODEL)["spec"]["ports"]}
    assert one(objects, "Namespace", NAMESPACE)["metadata"]["labels"]["istio-injection"] == "enabled"


@pytest.mark.parametrize("overlay", ["plain", "mig"])
def test_replica_ratio_overlays_have_no_istio_objects(overlay: str) -> None:
    objects = build(overlay)
    istio = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if "istio.io" in o["apiVersion"]]
    assert not istio
    assert "istio-injection" not in one(objects, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert not re.search(r"istio", kustomize_output(overlay)), "an Istio annotation or label is left"
