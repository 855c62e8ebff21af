"""How traffic reaches the serving pods and who may move it, in the Kubernetes manifests (infra/k8s):
the Service selects both tracks, a disruption budget and an autoscaler cover stable, the Ingress
terminates TLS and speaks gRPC (over TLS to the pods without a mesh, to nginx's sidecar with one), a
PodMonitor scrapes the metrics, and with Istio each model splits by weight, the mesh's STRICT mutual
TLS in place of the server's own (the replica-ratio stacks have no Istio objects). Every model of a
stack, each with its own objects, and none serving plain text outside a mesh. The rollout controller's
Role, derived from the requests it sends, is checked in test_rollout_rbac.py."""

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
# Istio's metrics merging: the injector turns these into its agent's port and path, and the agent reads
# the server's /metrics on localhost.
MERGED_METRICS = {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}


def service_host(model: str) -> str:
    return f"{model}.{NAMESPACE}.svc.cluster.local"


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


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_ingress_terminates_tls_and_speaks_grpc(stack: str, model: str) -> None:
    ingress = one(build_model(stack, model), "Ingress", model)
    annotations = ingress["metadata"]["annotations"]
    protocol = annotations["nginx.ingress.kubernetes.io/backend-protocol"]
    if stack == "istio":
        assert protocol == "GRPC", "nginx's own sidecar reads the requests to route them, then opens mTLS"
    else:
        assert protocol == "GRPCS", "the pods serve TLS"
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
    assert (endpoint["port"], endpoint["interval"]) == ("http", "15s")
    assert monitor["spec"]["podTargetLabels"] == ["sluicegate.io/track"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for deployment in deployments(objects, model).values():
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        prometheus = {key: value for key, value in annotations.items() if key.startswith("prometheus.io/")}
        assert prometheus == (MERGED_METRICS if stack == "istio" else {})
    if stack == "istio":
        # STRICT mTLS keeps Prometheus (outside the mesh) off port 8000: it reads the sidecar agent's
        # merged metrics in plain text, at the port the injector writes into prometheus.io/port.
        assert (endpoint["path"], endpoint["scheme"]) == ("/stats/prometheus", "http")
        assert "tlsConfig" not in endpoint
        [relabel] = endpoint["relabelings"]
        assert relabel["sourceLabels"] == ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"]
        assert relabel["targetLabel"] == "__address__" and relabel.get("action", "replace") == "replace"
        # Prometheus joins the source labels with ";", anchors the regex and expands $1 in the replacement.
        for address, expected in (("10.1.2.3:8000", "10.1.2.3:15020"), ("[fd00::1]:8000", "[fd00::1]:15020")):
            joined = f"{address};15020"
            replacement = re.sub(r"\$(\d)", r"\\\1", relabel["replacement"])
            assert re.sub(f"^(?:{relabel['regex']})$", replacement, joined) == expected
    else:
        assert (endpoint["path"], endpoint["scheme"]) == ("/metrics", "https"), "the pods serve TLS"
        tls = endpoint["tlsConfig"]
        assert tls["ca"]["secret"] == {"name": f"{model}-serving-tls", "key": "ca.crt"}
        assert tls["serverName"] == f"{model}.{NAMESPACE}.svc", "pod IPs are in no certificate"
        assert "relabelings" not in endpoint


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


@pytest.mark.parametrize("model", MODELS)
def test_istio_enforces_mutual_tls_on_the_models_pods(model: str) -> None:
    """The server leaves TLS to the mesh under Istio (test_k8s_pods.py), so the mesh must enforce it:
    a STRICT PeerAuthentication on exactly this model's serving pods, both tracks, and Istio mutual TLS
    from the client sidecars (the DestinationRule)."""
    objects = build("istio")
    [peer_authentication] = [
        o for o in of_kind(objects, "PeerAuthentication") if o["metadata"]["labels"]["app.kubernetes.io/name"] == model
    ]
    assert peer_authentication["apiVersion"] == "security.istio.io/v1"
    assert peer_authentication["metadata"]["name"] == model
    assert peer_authentication["spec"]["mtls"] == {"mode": "STRICT"}
    assert "portLevelMtls" not in peer_authentication["spec"], "no port open to plain text"
    selector = peer_authentication["spec"]["selector"]["matchLabels"]
    selected = {
        d["metadata"]["name"]
        for d in of_kind(objects, "Deployment")
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    }
    assert selected == {f"{model}-{track}" for track in TRACKS}
    rule = one(objects, "DestinationRule", model)
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "ISTIO_MUTUAL"}
    for subset in rule["spec"]["subsets"]:
        assert "trafficPolicy" not in subset, "a subset's policy would replace the rule's TLS"


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_no_stack_serves_plain_text_outside_the_mesh(stack: str, model: str) -> None:
    """Each model's pods either terminate TLS themselves (both ports, the certificate mounted) or sit
    in the mesh behind a STRICT PeerAuthentication that selects them, never neither."""
    objects = build(stack)
    strict = [p["spec"]["selector"]["matchLabels"] for p in of_kind(objects, "PeerAuthentication")
              if p["spec"]["mtls"]["mode"] == "STRICT"]  # fmt: skip
    in_mesh = one(objects, "Namespace", NAMESPACE)["metadata"].get("labels", {}).get("istio-injection") == "enabled"
    for deployment in deployments(objects, model).values():
        container, labels = server(deployment), deployment["spec"]["template"]["metadata"]["labels"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        own_tls = {"SLUICEGATE_SERVING__TLS_CERT_FILE", "SLUICEGATE_SERVING__TLS_KEY_FILE"} <= env.keys() and all(
            str(env[name]).rsplit("/", 1)[0] in mounts
            for name in ("SLUICEGATE_SERVING__TLS_CERT_FILE", "SLUICEGATE_SERVING__TLS_KEY_FILE")
        )
        mesh_tls = in_mesh and any(selector.items() <= labels.items() for selector in strict)
        assert own_tls != mesh_tls, f"{deployment['metadata']['name']}: TLS from the server {own_tls}, mesh {mesh_tls}"
        assert mesh_tls == (stack == "istio")


@pytest.mark.parametrize("stack", ["plain", "mig"])
def test_replica_ratio_stacks_have_no_istio_objects(stack: str) -> None:
    objects = build(stack)
    istio = [f"{o['kind']}/{o['metadata']['name']}" for o in objects if "istio.io" in o["apiVersion"]]
    assert not istio
    assert "istio-injection" not in one(objects, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert not re.search(r"istio", kustomize_output(stack)), "an Istio annotation or label is left"
