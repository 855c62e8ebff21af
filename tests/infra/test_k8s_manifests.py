"""Kubernetes manifests of the canary rollout (infra/k8s): every overlay builds with `kubectl kustomize`,
every object validates against the Kubernetes OpenAPI schema in strict mode (an unknown field fails) or,
for the CRDs, against the schemas in tests/infra/schemas, and the properties the rollout controller and
the cluster rely on hold: namespace, probes, GPU/MIG resources, least-privilege RBAC, traffic split,
sysctls, ingress, scraping."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from serving.settings import ServingSettings

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
BASE = K8S / "base"
README = K8S / "README.md"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
OVERLAYS = ("plain", "istio", "mig")

NAMESPACE = "sluicegate-serving"
MODEL = "pcb-classifier"
TRACKS = ("stable", "canary")
SERVICE_HOST = f"{MODEL}.{NAMESPACE}.svc.cluster.local"
MIG_RESOURCE = "nvidia.com/mig-1g.10gb"
CACHE_DIR = "/var/cache/sluicegate"
SETTINGS_PREFIX = "SLUICEGATE_SERVING__"
# The oldest Kubernetes the manifests target (tcp_fin_timeout is a safe sysctl from 1.29, the preStop
# sleep action is on by default from 1.30) and the newest schema kubernetes-validate bundles.
K8S_VERSIONS = ("1.31.0", kubernetes_validate.latest_version())
# Kubernetes' safe sysctls (kubelet pkg/kubelet/sysctl/safe_sysctls.go, 1.32+); any other sysctl needs
# the kubelet's --allowed-unsafe-sysctls, which infra/k8s/README.md must say.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
}
SYSCTLS = {"net.ipv4.ip_local_port_range": "1024 65535", "net.ipv4.tcp_fin_timeout": "15", "net.ipv4.tcp_tw_reuse": "1"}
CRD_SCHEMAS = {
    ("networking.istio.io/v1", "DestinationRule"): "destinationrule.json",
    ("networking.istio.io/v1", "VirtualService"): "virtualservice.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
}
CLUSTER_SCOPED = {"Namespace"}
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
INSTALL_KUBECTL = (
    "kubectl {need} is needed to build the kustomize overlays in infra/k8s: install kubectl 1.27 or newer "
    "(it bundles kustomize v5), e.g. from the Kubernetes apt repository (https://pkgs.k8s.io, package "
    "kubectl) or the Google Cloud SDK's apt repository (package kubectl); Debian's own kubernetes-client "
    "package is 1.20, whose kustomize is too old."
)


# --- building and loading ---------------------------------------------------------------------------


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
def _built(overlay: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return result.stdout


def build(overlay: str) -> list[Obj]:
    """The overlay's objects (a fresh copy each call, so a test may change them)."""
    docs = [doc for doc in yaml.safe_load_all(_built(overlay)) if doc is not None]
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_built_object_is_valid(overlay: str) -> None:
    errors = [error for obj in build(overlay) for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_valid(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no object"
    errors = [error for doc in docs for error in schema_errors(doc)]
    assert not errors, "\n".join(errors)


def _typo_in_probe(objects: list[Obj]) -> Obj:
    deployment = deployments(objects)["stable"]
    server(deployment)["readinessProbe"]["initialDelay"] = 30  # initialDelaySeconds
    return deployment


def _typo_in_spec(objects: list[Obj]) -> Obj:
    deployment = deployments(objects)["canary"]
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
        (_crd_without_schema, r"Couldn't find schema for kind VirtualService"),
    ],
    ids=[
        "deployment-probe-typo",
        "deployment-spec-typo",
        "service-port-string",
        "vs-weight-typo",
        "podmonitor-typo",
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


# --- properties of every overlay --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_serving_namespace(overlay: str) -> None:
    objects = build(overlay)
    namespaces = of_kind(objects, "Namespace")
    assert [ns["metadata"]["name"] for ns in namespaces] == [NAMESPACE]
    misplaced = [
        f"{obj['kind']}/{obj['metadata']['name']}: {obj['metadata'].get('namespace')}"
        for obj in objects
        if obj["kind"] not in CLUSTER_SCOPED and obj["metadata"].get("namespace") != NAMESPACE
    ]
    assert not misplaced, f"not in {NAMESPACE}: {misplaced}"
    for binding in of_kind(objects, "RoleBinding"):
        assert all(s.get("namespace") == NAMESPACE for s in binding["subjects"] if s["kind"] == "ServiceAccount")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_two_tracks_with_the_canary_scaled_to_zero(overlay: str) -> None:
    tracks = deployments(build(overlay))
    for track, deployment in tracks.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": MODEL, "sluicegate.io/track": track}
        for labels in (deployment["metadata"]["labels"], deployment["spec"]["template"]["metadata"]["labels"]):
            assert labels["app.kubernetes.io/name"] == MODEL
            assert labels["sluicegate.io/track"] == track
            assert re.fullmatch(r"[0-9]+", labels["sluicegate.io/model-version"])
        assert "sluicegate.io/model-version" not in selector, "the version changes; a selector cannot"
        version = deployment["metadata"]["labels"]["sluicegate.io/model-version"]
        env = {e["name"]: e for e in server(deployment)["env"]}
        assert env["SLUICEGATE_SERVING__REPOSITORY"]["value"] == f"models:/{MODEL}/{version}"
    assert tracks["canary"]["spec"]["replicas"] == 0
    assert "replicas" not in tracks["stable"]["spec"], "the HorizontalPodAutoscaler owns stable's replicas"


def _without_track(deployment: Obj) -> Obj:
    template = copy.deepcopy(deployment["spec"]["template"])
    template["metadata"]["labels"].pop("sluicegate.io/track")
    for constraint in template["spec"].get("topologySpreadConstraints", []):
        constraint["labelSelector"]["matchLabels"].pop("sluicegate.io/track")
    return template  # type: ignore[no-any-return]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stable_and_canary_run_the_same_pod(overlay: str) -> None:
    tracks = deployments(build(overlay))
    assert _without_track(tracks["stable"]) == _without_track(tracks["canary"]), (
        "deployment-stable.yaml and deployment-canary.yaml drifted apart"
    )
    assert tracks["stable"]["spec"]["strategy"] == tracks["canary"]["spec"]["strategy"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_probes(overlay: str) -> None:
    settings = ServingSettings()
    objects = build(overlay)
    for deployment in deployments(objects).values():
        container = server(deployment)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": settings.grpc_port, "http": settings.http_port} == {"grpc": 8001, "http": 8000}
        probes = {kind: container[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        paths = {kind: (p["httpGet"]["path"], p["httpGet"]["port"]) for kind, p in probes.items()}
        assert paths == {
            "startupProbe": ("/health/live", "http"),
            "livenessProbe": ("/health/live", "http"),
            "readinessProbe": ("/health/ready", "http"),
        }
        startup = probes["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "10 minutes for engine warm-up"
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain = float(serving_env(objects, deployment)["SLUICEGATE_SERVING__DRAIN_TIMEOUT_S"])
        assert pre_stop + drain < grace, "the drain must finish before the kubelet kills the pod"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_image_cmd_cannot_override_the_repository(overlay: str) -> None:
    """The image's CMD is `--repo /models`, a flag that would beat the env the controller patches."""
    for name, container in all_containers(build(overlay)):
        assert container["command"] == ["python3", "-m", "serving"], name
        assert "--repo" not in container.get("args", []), name


def serving_env(objects: list[Obj], deployment: Obj) -> dict[str, str]:
    """The container's plain env values, ConfigMaps (envFrom) first, then env on top."""
    container = server(deployment)
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = one(objects, "ConfigMap", source["configMapRef"]["name"])
        values.update(config_map["data"])
    values.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    return values


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_settings_are_fields_the_server_reads(overlay: str) -> None:
    """Each SLUICEGATE_SERVING__* variable names a ServingSettings field and parses as one (the server
    forbids unknown fields only in its constructor; a typoed variable would be silently ignored)."""
    objects = build(overlay)
    for deployment in deployments(objects).values():
        container = server(deployment)
        names = {e["name"] for e in container["env"]} | set(serving_env(objects, deployment))
        fields = {name.removeprefix(SETTINGS_PREFIX).lower() for name in names if name.startswith(SETTINGS_PREFIX)}
        unknown = fields - set(ServingSettings.model_fields)
        assert not unknown, f"not ServingSettings fields: {sorted(unknown)}"
        values = {
            name.removeprefix(SETTINGS_PREFIX).lower(): value
            for name, value in serving_env(objects, deployment).items()
            if name.startswith(SETTINGS_PREFIX)
        }
        settings = ServingSettings.model_validate(values)
        assert settings.host == "0.0.0.0"
        assert str(settings.cache_dir) == CACHE_DIR
        assert settings.repository.startswith(f"models:/{MODEL}")
        token = next(e for e in container["env"] if e["name"] == "SLUICEGATE_SERVING__ADMIN_TOKEN")
        assert "secretKeyRef" in token["valueFrom"], "the admin token comes from a Secret"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_locked_down(overlay: str) -> None:
    for deployment in deployments(build(overlay)).values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == MODEL
        pod_security = pod["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["runAsUser"] == 10001
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        container = server(deployment)
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == 10001
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        cache_volume = volumes[mounts[CACHE_DIR]]
        assert "emptyDir" in cache_volume or "persistentVolumeClaim" in cache_volume
        assert not any(m.get("readOnly") for m in container["volumeMounts"] if m["mountPath"] == CACHE_DIR)
        assert "/tmp" in mounts, "a writable /tmp on the read-only root"
        resources = container["resources"]
        for key in ("cpu", "memory"):
            assert key in resources["requests"] and key in resources["limits"], key
    service_account = one(build(overlay), "ServiceAccount", MODEL)
    assert service_account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sysctls_for_many_grpc_connections(overlay: str) -> None:
    readme = README.read_text()
    for deployment in deployments(build(overlay)).values():
        sysctls = {s["name"]: s["value"] for s in deployment["spec"]["template"]["spec"]["securityContext"]["sysctls"]}
        assert sysctls == SYSCTLS
        for name in set(sysctls) - SAFE_SYSCTLS:
            assert name in readme and "--allowed-unsafe-sysctls" in readme, (
                f"{name} is not a safe sysctl: infra/k8s/README.md must say how to allow it"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_resources(overlay: str) -> None:
    for name, container in all_containers(build(overlay)):
        resources = container["resources"]
        for part in ("requests", "limits"):
            gpus = {k: v for k, v in resources[part].items() if k.startswith("nvidia.com/")}
            if overlay == "mig":
                assert gpus == {MIG_RESOURCE: 1}, f"{name} {part}: {gpus}"
            else:
                assert gpus == {"nvidia.com/gpu": 1}, f"{name} {part}: {gpus}"


def test_mig_overlay_pins_mig_nodes_and_asks_no_full_gpu() -> None:
    objects = build("mig")
    built = _built("mig")
    assert not re.search(r"^\s*nvidia\.com/gpu:\s", built, re.MULTILINE), "a full-GPU request is left"
    for deployment in deployments(objects).values():
        assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/mig.config": "all-1g.10gb"}
    for overlay in ("plain", "istio"):
        for deployment in deployments(build(overlay)).values():
            assert "nodeSelector" not in deployment["spec"]["template"]["spec"]


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
    assert not re.search(r"istio", _built(overlay)), "an Istio annotation or label is left"
