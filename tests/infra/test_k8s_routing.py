"""How traffic reaches the serving pods and who may move it, in the Kubernetes manifests (infra/k8s):
the Service selects both tracks, a disruption budget and an autoscaler cover stable, the rollout
controller's Role is least privilege, the Ingress terminates TLS and speaks gRPC, a PodMonitor scrapes
the metrics, and with Istio each model splits by weight (the replica-ratio stacks have no Istio objects).
Every model of a stack, each with its own objects."""

from __future__ import annotations

import re

import pytest

from tests.infra.k8s_manifests import (
    MODELS,
    NAMESPACE,
    STACKS,
    TRACKS,
    build,
    build_model,
    deployments,
    kustomize_output,
    model_arguments,
    of_kind,
    one,
    server,
)

STACK_MODELS = [(stack, model) for stack in STACKS for model in MODELS]


def service_host(model: str) -> str:
    return f"{model}.{NAMESPACE}.svc.cluster.local"


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


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_service_selects_both_tracks(stack: str, model: str) -> None:
    objects = build_model(stack, model)
    service = one(objects, "Service", model)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "http"}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"], ports["grpc"]["appProtocol"]) == (8001, "grpc", "grpc")
    assert (ports["http"]["port"], ports["http"]["targetPort"]) == (8000, "http")
    selector = service["spec"]["selector"]
    assert "sluicegate.io/track" not in selector
    for deployment in deployments(objects, model).values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert {p["targetPort"] for p in ports.values()} <= {p["name"] for p in server(deployment)["ports"]}


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_disruption_budget_and_autoscaler_cover_stable(stack: str, model: str) -> None:
    objects = build_model(stack, model)
    stable = deployments(objects, model)["stable"]
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert len(budgets) == 1
    budget = budgets[0]["spec"]
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable") == 1
    assert budget["selector"]["matchLabels"] == stable["spec"]["selector"]["matchLabels"]
    hpa = one(objects, "HorizontalPodAutoscaler", f"{model}-stable")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", f"{model}-stable")
    assert hpa["spec"]["minReplicas"] == model_arguments(stack, model)["replicas"]
    assert hpa["spec"]["minReplicas"] >= 2, "a budget of one unavailable pod needs two to drain a node"
    assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
    containers = {c["name"] for c in stable["spec"]["template"]["spec"]["containers"]}
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "ContainerResource":
            assert metric["containerResource"]["container"] in containers


@pytest.mark.parametrize("stack", STACKS)
def test_rollout_role_is_least_privilege(stack: str) -> None:
    objects = build(stack)
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
    expected = ROLLOUT_RULES | (ISTIO_RULES if stack == "istio" else {})
    assert granted == expected
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    binding = one(objects, "RoleBinding", "sluicegate-rollout")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sluicegate-rollout"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sluicegate-rollout", "namespace": NAMESPACE}]
    one(objects, "ServiceAccount", "sluicegate-rollout")
    for deployment in of_kind(objects, "Deployment"):
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] != "sluicegate-rollout"


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_ingress_terminates_tls_and_speaks_grpc(stack: str, model: str) -> None:
    ingress = one(build_model(stack, model), "Ingress", model)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    [tls] = ingress["spec"]["tls"]
    assert tls["secretName"]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] in tls["hosts"]
    assert rule["host"] == f"{model}.example.com" and tls["secretName"] == f"{model}-tls"
    [path] = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": model, "port": {"name": "grpc"}}
    if stack == "istio":
        assert annotations["nginx.ingress.kubernetes.io/service-upstream"] == "true"
        assert annotations["nginx.ingress.kubernetes.io/upstream-vhost"] == service_host(model)
    else:
        assert "nginx.ingress.kubernetes.io/upstream-vhost" not in annotations


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_podmonitor_scrapes_metrics_every_15s(stack: str, model: str) -> None:
    objects = build_model(stack, model)
    monitor = one(objects, "PodMonitor", model)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for deployment in deployments(objects, model).values():
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert "prometheus.io/scrape" not in deployment["spec"]["template"]["metadata"].get("annotations", {})


@pytest.mark.parametrize("model", MODELS)
def test_istio_splits_by_weight_with_all_traffic_on_stable(model: str) -> None:
    objects = build_model("istio", model)
    rule = one(objects, "DestinationRule", model)
    assert rule["spec"]["host"] == service_host(model)
    subsets = {s["name"]: s["labels"] for s in rule["spec"]["subsets"]}
    assert subsets == {track: {"sluicegate.io/track": track} for track in TRACKS}
    for track, deployment in deployments(objects, model).items():
        assert subsets[track].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    service = one(objects, "VirtualService", model)
    assert service["spec"]["hosts"] == [service_host(model)]
    [route] = service["spec"]["http"]
    weights = {r["destination"]["subset"]: r["weight"] for r in route["route"]}
    assert weights == {"stable": 100, "canary": 0}
    assert sum(weights.values()) == 100
    assert all(r["destination"]["host"] == service_host(model) for r in route["route"])
    assert "grpc" in {p["name"] for p in one(objects, "Service", model)["spec"]["ports"]}
    for deployment in deployments(objects, model).values():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert "holdApplicationUntilProxyStarts" in annotations["proxy.istio.io/config"]
    assert one(build("istio"), "Namespace", NAMESPACE)["metadata"]["labels"]["istio-injection"] == "enabled"


@pytest.mark.parametrize("stack", ["plain", "mig"])
def test_replica_ratio_stacks_have_no_istio_objects(stack: str) -> None:
    objects = build(stack)
    istio = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if "istio.io" in o["apiVersion"]]
    assert not istio
    assert "istio-injection" not in one(objects, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert not re.search(r"istio", kustomize_output(stack)), "an Istio annotation or label is left"
