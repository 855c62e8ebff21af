"""The serving pods of the Kubernetes manifests (infra/k8s), for every model in every stack: one
namespace, two tracks (stable, canary) running the same pod with the canary at zero, ports and probes
that fit the drain, server settings that are ServingSettings fields, a locked-down security context, the
sysctls for many gRPC connections, and the model's CPU, memory and GPU or MIG resources. Without a mesh
the server serves TLS from its Secret; with Istio it leaves encryption to the mesh's mutual TLS (the
PeerAuthentication and DestinationRule are checked in test_k8s_routing.py)."""

from __future__ import annotations

import copy
import re

import pytest

from serving.settings import ServingSettings
from tests.infra.k8s_manifests import (
    K8S,
    MODELS,
    NAMESPACE,
    STACKS,
    Obj,
    all_containers,
    build,
    build_model,
    deployments,
    model_arguments,
    model_output,
    of_kind,
    one,
    server,
    serving_env,
)

README = K8S / "README.md"
MIG_RESOURCE = "nvidia.com/mig-1g.10gb"
CACHE_DIR = "/var/cache/sluicegate"
SETTINGS_PREFIX = "SLUICEGATE_SERVING__"
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
CLUSTER_SCOPED = {"Namespace"}
STACK_MODELS = [(stack, model) for stack in STACKS for model in MODELS]
# The stacks whose server terminates TLS itself; under Istio the mesh's mutual TLS replaces it (the
# sidecars must read HTTP/2 to split requests by weight).
SERVER_TLS_STACKS = ("plain", "mig")
SERVER_TLS_MODELS = [(stack, model) for stack in SERVER_TLS_STACKS for model in MODELS]
TLS_SETTINGS = {f"{SETTINGS_PREFIX}{name.upper()}" for name in ServingSettings.model_fields if name.startswith("tls_")}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# --- properties of every model in every stack ------------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_everything_lives_in_the_serving_namespace(stack: str) -> None:
    objects = build(stack)
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


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_two_tracks_with_the_canary_scaled_to_zero(stack: str, model: str) -> None:
    tracks = deployments(build_model(stack, model), model)
    for track, deployment in tracks.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": model, "sluicegate.io/track": track}
        for labels in (deployment["metadata"]["labels"], deployment["spec"]["template"]["metadata"]["labels"]):
            assert labels["app.kubernetes.io/name"] == model
            assert labels["sluicegate.io/track"] == track
            assert re.fullmatch(r"[0-9]+", labels["sluicegate.io/model-version"])
        assert "sluicegate.io/model-version" not in selector, "the version changes; a selector cannot"
        version = deployment["metadata"]["labels"]["sluicegate.io/model-version"]
        env = {e["name"]: e for e in server(deployment)["env"]}
        assert env["SLUICEGATE_SERVING__REPOSITORY"]["value"] == f"models:/{model}/{version}"
        assert version == model_arguments(stack, model).get("version", "1")
    assert tracks["canary"]["spec"]["replicas"] == 0
    assert "replicas" not in tracks["stable"]["spec"], "the HorizontalPodAutoscaler owns stable's replicas"


def _without_track(deployment: Obj) -> Obj:
    template = copy.deepcopy(deployment["spec"]["template"])
    template["metadata"]["labels"].pop("sluicegate.io/track")
    for constraint in template["spec"].get("topologySpreadConstraints", []):
        constraint["labelSelector"]["matchLabels"].pop("sluicegate.io/track")
    return template  # type: ignore[no-any-return]


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_stable_and_canary_run_the_same_pod(stack: str, model: str) -> None:
    tracks = deployments(build_model(stack, model), model)
    assert _without_track(tracks["stable"]) == _without_track(tracks["canary"]), (
        "deployment-stable.yaml and deployment-canary.yaml drifted apart"
    )
    assert tracks["stable"]["spec"]["strategy"] == tracks["canary"]["spec"]["strategy"]


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_ports_and_probes(stack: str, model: str) -> None:
    settings = ServingSettings()
    objects = build_model(stack, model)
    for deployment in deployments(objects, model).values():
        container = server(deployment)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": settings.grpc_port, "http": settings.http_port} == {"grpc": 8001, "http": 8000}
        probes = {kind: container[kind] for kind in PROBES}
        paths = {kind: (p["httpGet"]["path"], p["httpGet"]["port"]) for kind, p in probes.items()}
        assert paths == {
            "startupProbe": ("/health/live", "http"),
            "livenessProbe": ("/health/live", "http"),
            "readinessProbe": ("/health/ready", "http"),
        }
        startup = probes["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "10 minutes for engine warm-up"
        # Under Istio the injector rewrites HTTP probes to its agent, which calls the server on localhost.
        scheme = "HTTPS" if stack in SERVER_TLS_STACKS else "HTTP"
        for kind, probe in probes.items():
            assert probe["httpGet"].get("scheme", "HTTP") == scheme, f"{kind}: the HTTP port serves {scheme}"
            assert "grpc" not in probe, f"{kind}: a gRPC probe does not do TLS"


def _setting(objects: list[Obj], deployment: Obj, name: str) -> float:
    """A ServingSettings number as the pod gets it: the manifests' env, else the field's default."""
    value = serving_env(objects, deployment).get(SETTINGS_PREFIX + name.upper())
    return float(value if value is not None else ServingSettings.model_fields[name].default)


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_shutdown_fits_the_grace_period(stack: str, model: str) -> None:
    """On SIGTERM the server keeps serving while not ready (shutdown_delay_s), then drains
    (drain_timeout_s); the kubelet kills the pod terminationGracePeriodSeconds after SIGTERM. Set
    explicitly in the manifests, and the server's own delay replaces a preStop sleep."""
    objects = build_model(stack, model)
    for deployment in deployments(objects, model).values():
        container = server(deployment)
        explicit = {e["name"] for e in container["env"]}
        assert {"SLUICEGATE_SERVING__SHUTDOWN_DELAY_S", "SLUICEGATE_SERVING__DRAIN_TIMEOUT_S"} <= explicit
        delay = _setting(objects, deployment, "shutdown_delay_s")
        drain = _setting(objects, deployment, "drain_timeout_s")
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > pre_stop + delay + drain, "the drain must finish before the kubelet kills the pod"
        assert delay > 0, "endpoints need a moment to drop the pod before it stops accepting"


def _server_settings(objects: list[Obj], deployment: Obj) -> ServingSettings:
    return ServingSettings.model_validate(
        {k.removeprefix(SETTINGS_PREFIX).lower(): v for k, v in serving_env(objects, deployment).items()
         if k.startswith(SETTINGS_PREFIX)}
    )  # fmt: skip


@pytest.mark.parametrize(("stack", "model"), SERVER_TLS_MODELS)
def test_the_server_serves_tls_from_its_secret(stack: str, model: str) -> None:
    objects = build_model(stack, model)
    for deployment in deployments(objects, model).values():
        pod, container = deployment["spec"]["template"]["spec"], server(deployment)
        settings = _server_settings(objects, deployment)
        assert settings.tls, "TLS is on by default in the manifests"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = {}
        for mount in container["volumeMounts"]:
            if "secret" in volumes[mount["name"]]:
                assert mount.get("readOnly") is True
                mounted[mount["mountPath"]] = volumes[mount["name"]]["secret"]
        files = {settings.tls_cert_file, settings.tls_key_file}
        [(folder, secret)] = mounted.items()
        assert {str(f.parent) for f in files if f is not None} == {folder}
        assert {f.name for f in files if f is not None} == {"tls.crt", "tls.key"}, "a kubernetes.io/tls Secret's keys"
        assert secret["secretName"] == f"{model}-serving-tls"
        assert not secret.get("optional"), "a pod without its certificate must not start in plain text"
        assert secret.get("defaultMode", 0o644) & 0o007 == 0, "the key is not world-readable"
        for kind in PROBES:
            assert container[kind]["httpGet"]["scheme"] == "HTTPS", kind


@pytest.mark.parametrize("model", MODELS)
def test_under_istio_the_server_leaves_tls_to_the_mesh(model: str) -> None:
    """The sidecars split requests by weight at the HTTP/2 level, which they cannot do inside TLS the
    server terminates: with the istio component the server serves plain text to its own sidecar only
    (the STRICT PeerAuthentication, test_k8s_routing.py), with no TLS setting, no certificate mounted
    and HTTP probes; the rest of the pod is the one the other stacks run."""
    objects = build_model("istio", model)
    for track, deployment in deployments(objects, model).items():
        pod, container = deployment["spec"]["template"]["spec"], server(deployment)
        assert not _server_settings(objects, deployment).tls, f"{track}: the server terminates TLS"
        names = {e["name"] for e in container["env"]} | set(serving_env(objects, deployment))
        assert not names & TLS_SETTINGS, f"{track}: TLS settings left: {sorted(names & TLS_SETTINGS)}"
        assert not [v["name"] for v in pod["volumes"] if "secret" in v], f"{track}: a Secret is still mounted"
        assert "/etc/sluicegate/tls" not in {m["mountPath"] for m in container["volumeMounts"]}
        assert {container[kind]["httpGet"].get("scheme", "HTTP") for kind in PROBES} == {"HTTP"}
        # What the mesh changes, and nothing else: the same pod as without it once TLS is taken out.
        [plain] = [d for d in deployments(build_model("plain", model), model).values()
                   if d["metadata"]["name"] == deployment["metadata"]["name"]]  # fmt: skip
        plain_pod = copy.deepcopy(plain["spec"]["template"])
        plain_server = plain_pod["spec"]["containers"][0]
        plain_server["env"] = [e for e in plain_server["env"] if e["name"] not in TLS_SETTINGS]
        plain_server["volumeMounts"] = [m for m in plain_server["volumeMounts"] if m["name"] != "tls"]
        plain_pod["spec"]["volumes"] = [v for v in plain_pod["spec"]["volumes"] if v["name"] != "tls"]
        for kind in PROBES:
            plain_server[kind]["httpGet"]["scheme"] = "HTTP"
        istio_pod = copy.deepcopy(deployment["spec"]["template"])
        istio_pod["metadata"].pop("annotations")
        assert istio_pod == plain_pod, f"{track}: the istio component changed more than the server's TLS"


@pytest.mark.parametrize("stack", STACKS)
def test_the_image_cmd_cannot_override_the_repository(stack: str) -> None:
    """The image's CMD is `--repo /models`, a flag that would beat the env the controller patches."""
    for name, container in all_containers(build(stack)):
        assert container["command"] == ["python3", "-m", "serving"], name
        assert "--repo" not in container.get("args", []), name


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_server_settings_are_fields_the_server_reads(stack: str, model: str) -> None:
    """Each SLUICEGATE_SERVING__* variable names a ServingSettings field and parses as one (the server
    forbids unknown fields only in its constructor; a typoed variable would be silently ignored)."""
    objects = build_model(stack, model)
    for deployment in deployments(objects, model).values():
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
        assert settings.repository.startswith(f"models:/{model}/")
        token = next(e for e in container["env"] if e["name"] == "SLUICEGATE_SERVING__ADMIN_TOKEN")
        assert "secretKeyRef" in token["valueFrom"], "the admin token comes from a Secret"


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_pods_run_locked_down(stack: str, model: str) -> None:
    for deployment in deployments(build_model(stack, model), model).values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == model
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
    service_account = one(build_model(stack, model), "ServiceAccount", model)
    assert service_account["automountServiceAccountToken"] is False


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_sysctls_for_many_grpc_connections(stack: str, model: str) -> None:
    readme = README.read_text()
    for deployment in deployments(build_model(stack, model), model).values():
        sysctls = {s["name"]: s["value"] for s in deployment["spec"]["template"]["spec"]["securityContext"]["sysctls"]}
        assert sysctls == SYSCTLS
        for name in set(sysctls) - SAFE_SYSCTLS:
            assert name in readme and "--allowed-unsafe-sysctls" in readme, (
                f"{name} is not a safe sysctl: infra/k8s/README.md must say how to allow it"
            )


@pytest.mark.parametrize(("stack", "model"), STACK_MODELS)
def test_the_models_resources(stack: str, model: str) -> None:
    """CPU and memory as the model asks (requests = limits), its GPUs, MIG slices or none, and GPU
    nodes' taint tolerated only by pods that need a GPU."""
    arguments = model_arguments(stack, model)
    gpu = arguments.get("gpu", 0)
    expected_gpus = {MIG_RESOURCE if arguments.get("mig") else "nvidia.com/gpu": str(gpu)} if gpu else {}
    for deployment in deployments(build_model(stack, model), model).values():
        resources = server(deployment)["resources"]
        for part in ("requests", "limits"):
            gpus = {k: v for k, v in resources[part].items() if k.startswith("nvidia.com/")}
            assert gpus == expected_gpus, f"{deployment['metadata']['name']} {part}: {gpus}"
            assert (resources[part]["cpu"], resources[part]["memory"]) == (arguments["cpu"], arguments["memory"])
        tolerations = deployment["spec"]["template"]["spec"].get("tolerations", [])
        assert bool(tolerations) == bool(gpu), "GPU pods tolerate the GPU taint, CPU pods do not"


@pytest.mark.parametrize("model", MODELS)
def test_mig_pins_mig_nodes_and_asks_no_full_gpu(model: str) -> None:
    built = model_output("mig", model)
    assert not re.search(r"^\s*nvidia\.com/gpu:\s", built, re.MULTILINE), "a full-GPU request is left"
    for deployment in deployments(build_model("mig", model), model).values():
        assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/mig.config": "all-1g.10gb"}
    for stack in ("plain", "istio"):
        for deployment in deployments(build_model(stack, model), model).values():
            assert "nodeSelector" not in deployment["spec"]["template"]["spec"]
