"""The rollout controller's Role is derived from what the code calls, not written by hand: every request
the Kubernetes rollout platform (tasks/rollout/kubernetes.py) sends to the API simulator (kmock,
tests/tasks/kmock_cluster.py) during whole rollouts (5 -> 20 -> 50 -> 100 %, promote) and rollbacks, by
replica ratio and by Istio weights, on a bare cluster and on the built manifests, is recorded as the
(verb, apiGroup, resource[/subresource]) RBAC checks, and the Role each stack builds (infra/k8s base,
and overlays/istio) must grant exactly those: a grant the code never uses is a finding, and so is a
call the Role would refuse with 403 in a real cluster.

Recorded from the HTTP method and path kmock received (its request log), so it is what goes over the
wire, whatever client method produced it."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
from kubernetes.client import AppsV1Api, CoreV1Api, CustomObjectsApi, V1Deployment, V1Service

from tasks.rollout import kubernetes_objects as k8s
from tests.infra.k8s_manifests import NAMESPACE, STACKS, build, build_model, of_kind, one
from tests.tasks.kmock_cluster import NS, Cluster

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "tasks" / "rollout" / "kubernetes.py"
ROLE = "sluicegate-rollout"
Grant = tuple[str, str, str]  # (verb, apiGroup, resource[/subresource])
# kube-apiserver's request verbs (k8s.io/apiserver, RequestInfoFactory).
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/[^/]+)(?P<rest>/.*)?$")
# The stack a Role is built for -> whether its controller runs with SLUICEGATE_ROLLOUT__ISTIO.
ISTIO = {"plain": False, "mig": False, "istio": True}
MODEL = "digits"  # a checked-in example: CPU only, so its pods need nothing the simulator lacks


def rbac_request(method: str, path: str, query: dict[str, str]) -> Grant:
    """What the API server's authorizer checks for one request (namespaced resources only: the Role
    cannot grant anything else, so anything else fails here)."""
    match = _PATH.match(path)
    assert match is not None, f"{method} {path}: not a resource request (a Role grants none)"
    group = "" if match["core"] else match["group"]
    parts = (match["rest"] or "/").strip("/").split("/")
    assert len(parts) >= 2 and parts[0] == "namespaces", f"{method} {path}: not namespaced"
    assert parts[1] == NS, f"{method} {path}: outside {NS}"
    resource, name, subresource = [*parts[2:], None, None, None][:3]
    assert resource, f"{method} {path}: the namespace itself"
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("1", "true") else "list")
    elif method == "DELETE" and not name:
        verb = "deletecollection"
    else:
        verb = _VERBS[method]
    return verb, group, f"{resource}/{subresource}" if subresource else resource


APPS, CORE = f"/apis/apps/v1/namespaces/{NS}", f"/api/v1/namespaces/{NS}"


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", f"{APPS}/deployments/x", {}, ("get", "apps", "deployments")),
        ("GET", f"{APPS}/deployments", {}, ("list", "apps", "deployments")),
        ("GET", f"{APPS}/deployments", {"watch": "true"}, ("watch", "apps", "deployments")),
        ("PATCH", f"{APPS}/deployments/x/scale", {}, ("patch", "apps", "deployments/scale")),
        ("PUT", f"{CORE}/services/x", {}, ("update", "", "services")),
        ("DELETE", f"{APPS}/deployments/x", {}, ("delete", "apps", "deployments")),
        ("DELETE", f"{APPS}/deployments", {}, ("deletecollection", "apps", "deployments")),
        (
            "POST",
            f"/apis/networking.istio.io/v1/namespaces/{NS}/virtualservices",
            {},
            ("create", "networking.istio.io", "virtualservices"),
        ),
    ],
)
def test_requests_map_to_the_verbs_the_authorizer_checks(
    method: str, path: str, query: dict[str, str], expected: Grant
) -> None:
    assert rbac_request(method, path, query) == expected


# --- recording the controller's calls ---------------------------------------------------------------------


def _recorded(cluster: Cluster, scenario: Callable[[], None]) -> set[Grant]:
    """The requests kmock receives while ``scenario`` runs (the setup before it is not the controller's;
    the simulated kubelet writes objects in-process, never over HTTP)."""
    start = cluster.in_loop(lambda: len(list(cluster.server)))
    scenario()
    requests = cluster.in_loop(lambda: list(cluster.server)[start:])
    assert requests, "the scenario sent nothing"
    return {rbac_request(r.method.value, r.url.path, dict(r.params)) for r in requests}


def _apply_manifests(cluster: Cluster, istio: bool) -> None:
    """What `kubectl apply -k` of the model's overlay leaves of the objects the controller touches: the
    idle canary placeholder and, with Istio, the DestinationRule and VirtualService already there."""
    objects = {(o["kind"], o["metadata"]["name"]): o for o in build_model("istio" if istio else "plain", MODEL)}
    for track in (k8s.stable_name(MODEL), k8s.canary_name(MODEL)):
        body = objects["Deployment", track]
        if track == k8s.stable_name(MODEL):
            body["spec"]["replicas"] = 2  # what the autoscaler would have set
        AppsV1Api(cluster.client).create_namespaced_deployment(NS, V1Deployment.model_validate(body))
    CoreV1Api(cluster.client).create_namespaced_service(NS, V1Service.model_validate(objects["Service", MODEL]))
    if istio:
        for kind, plural in (("DestinationRule", "destinationrules"), ("VirtualService", "virtualservices")):
            CustomObjectsApi(cluster.client).create_namespaced_custom_object(
                k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, NS, plural, objects[kind, MODEL]
            )


def _bare_cluster(cluster: Cluster, istio: bool) -> None:
    """Only stable and the Service: the controller creates the canary and, with Istio, the routing."""
    objects = {(o["kind"], o["metadata"]["name"]): o for o in build_model("plain", MODEL)}
    body = objects["Deployment", k8s.stable_name(MODEL)]
    body["spec"]["replicas"] = 2
    AppsV1Api(cluster.client).create_namespaced_deployment(NS, V1Deployment.model_validate(body))
    CoreV1Api(cluster.client).create_namespaced_service(NS, V1Service.model_validate(objects["Service", MODEL]))


def _foreign_routing(cluster: Cluster, istio: bool) -> None:
    """A bare cluster where someone else's DestinationRule for the model lacks the track subsets: the
    controller patches them in."""
    _bare_cluster(cluster, istio)
    if istio:
        rule = k8s.destination_rule(MODEL)
        rule["spec"]["subsets"] = [{"name": "v1", "labels": {"version": "v1"}}]
        CustomObjectsApi(cluster.client).create_namespaced_custom_object(
            k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, NS, "destinationrules", rule
        )


def _full_rollouts_and_rollbacks(cluster: Cluster, istio: bool) -> None:
    platform = cluster.platform(istio=istio)
    platform.start_canary(MODEL, "2")
    for percent in (5, 20, 50, 100):
        platform.set_weight(MODEL, percent)
    platform.promote(MODEL)
    assert platform.state(MODEL).stable_version == "2"
    platform.start_canary(MODEL, "3")
    platform.set_weight(MODEL, 20)
    platform.rollback(MODEL)
    assert platform.state(MODEL).canary_version is None


@cache
def controller_calls(istio: bool) -> frozenset[Grant]:
    """Every (verb, group, resource) the controller sends in the scenarios, bare cluster and manifests."""
    calls: set[Grant] = set()
    for setup in (_bare_cluster, _apply_manifests, _foreign_routing):
        cluster = Cluster()
        try:
            setup(cluster, istio)
            calls |= _recorded(cluster, lambda c=cluster: _full_rollouts_and_rollbacks(c, istio))
        finally:
            cluster.close()
    return frozenset(calls)


def _client_calls() -> Iterator[tuple[str, str]]:
    """(client, method) for every API call in the controller's source: self._apps.x(...) and the like."""
    for node in ast.walk(ast.parse(CONTROLLER.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in ("_apps", "_core", "_custom"):
                yield owner.attr, node.func.attr


def granted(stack: str) -> set[Grant]:
    role = one(build(stack), "Role", ROLE)
    grants: set[Grant] = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants |= {(verb, group, resource) for verb in rule["verbs"]}
    return grants


# --- the tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("istio", [False, True], ids=["plain", "istio"])
def test_the_scenarios_exercise_every_api_call_in_the_controller(istio: bool) -> None:
    """Guards the derivation: a call site no scenario reaches would be missing from the Role."""
    groups = {"_apps": {"apps"}, "_core": {""}, "_custom": {k8s.ISTIO_GROUP}}
    prefixes = {"read": "get", "get": "get", "list": "list", "create": "create", "patch": "patch",
                "replace": "update", "delete": "delete"}  # fmt: skip
    recorded = {(verb, group) for verb, group, _ in controller_calls(istio)}
    for client, method in set(_client_calls()):
        verb = prefixes[method.split("_", 1)[0]]
        if client == "_custom" and not istio:
            continue
        assert {(verb, group) for group in groups[client]} <= recorded, f"{client}.{method} never ran"


def test_what_the_controller_calls() -> None:
    """The derived set, spelled out so a change in it shows in review."""
    core = {
        ("get", "apps", "deployments"),
        ("create", "apps", "deployments"),
        ("patch", "apps", "deployments"),
        ("delete", "apps", "deployments"),
        ("get", "", "services"),
    }
    routing = {(verb, k8s.ISTIO_GROUP, plural) for verb in ("get", "create", "patch")
               for plural in ("destinationrules", "virtualservices")}  # fmt: skip
    assert controller_calls(False) == core
    assert controller_calls(True) == core | routing


@pytest.mark.parametrize("stack", STACKS)
def test_the_role_grants_exactly_what_the_controller_calls(stack: str) -> None:
    grants, calls = granted(stack), set(controller_calls(ISTIO[stack]))
    assert not calls - grants, f"the controller would get 403 for {sorted(calls - grants)}"
    assert not grants - calls, f"granted but never called (least privilege): {sorted(grants - calls)}"


@pytest.mark.parametrize("stack", STACKS)
def test_the_role_is_namespaced_bound_to_the_controller_only(stack: str) -> None:
    objects = build(stack)
    role = one(objects, "Role", ROLE)
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for field in ("apiGroups", "resources", "verbs"):
            assert not any("*" in value for value in rule[field]), f"wildcard in {field}: {rule}"
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    binding = one(objects, "RoleBinding", ROLE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": ROLE, "namespace": NAMESPACE}]
    one(objects, "ServiceAccount", ROLE)
    for deployment in of_kind(objects, "Deployment"):
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] != ROLE
