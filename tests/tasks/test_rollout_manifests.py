"""A model's Kubernetes overlay (tasks/rollout/manifests.py): what it refuses, that the checked-in
examples are its output, and a whole rollout by the unchanged controller on two models' built
manifests in the API simulator (tests/tasks/kmock_cluster.py), one model's rollout leaving the other's
objects alone. How the built objects validate and select is in tests/infra/test_k8s_*.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kubernetes.client import AppsV1Api, CoreV1Api, CustomObjectsApi, V1Deployment, V1Service

from tasks.rollout import kubernetes_objects as k8s
from tasks.rollout.manifests import model_overlay
from tasks.rollout.platform import PlatformState
from tests.infra.k8s_manifests import EXAMPLES, K8S, build_model
from tests.tasks.kmock_cluster import ISTIO, NS, Cluster


@pytest.mark.parametrize("model", sorted(EXAMPLES))
def test_the_checked_in_overlays_are_its_output(model: str) -> None:
    files = model_overlay(model, **EXAMPLES[model])
    folder = K8S / "models" / model
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    for name, text in files.items():
        assert (folder / name).read_text() == text, f"{folder / name} drifted: regenerate it (infra/k8s/README.md)"


def test_the_files() -> None:
    files = model_overlay("digits", replicas=3, cpu="500m", memory="512Mi", gpu=2, image="r.io/s:2.1", mig=True)
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert kustomization["components"] == ["../../components/model", "../../components/istio", "../../components/mig"]
    assert kustomization["images"] == [{"name": "sluicegate-serving", "newName": "r.io/s", "newTag": "2.1"}]
    [resources, autoscaler] = kustomization["patches"]
    [replace] = yaml.safe_load(resources["patch"])
    expected = {"cpu": "500m", "memory": "512Mi", "nvidia.com/mig-1g.10gb": "2"}
    assert replace["value"] == {"requests": expected, "limits": expected}
    assert [op["value"] for op in yaml.safe_load(autoscaler["patch"])] == [3, 12]
    config = yaml.safe_load(files["model.yaml"])
    assert config["metadata"]["annotations"] == {"config.kubernetes.io/local-config": "true"}
    assert config["data"] == {"name": "digits", "version": "1", "host": "digits.example.com"}


def test_an_image_by_digest_or_registry_port() -> None:
    digest = "sha256:" + "a" * 64
    for image, entry in [
        (f"r.io:5000/s@{digest}", {"newName": "r.io:5000/s", "digest": digest}),
        ("r.io:5000/s", {"newName": "r.io:5000/s"}),
    ]:
        [found] = yaml.safe_load(model_overlay("m", image=image)["kustomization.yaml"])["images"]
        assert found == {"name": "sluicegate-serving", **entry}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"model": "PCB_Classifier"}, r"model: 'PCB_Classifier' is not a valid model name.*lower-case"),
        ({"model": "a" * 41}, r"model: .*1-40"),
        ({"model": "-pcb"}, r"model: '-pcb'.*starting and ending with a letter or digit"),
        ({"model": ""}, r"model: ''"),
        ({"replicas": 0}, r"replicas: 0 .*at least 1"),
        ({"replicas": 4, "max_replicas": 2}, r"max_replicas: 2 .*at least replicas \(4\)"),
        ({"cpu": "two"}, r"cpu: 'two'.*'500m'"),
        ({"memory": "8 GB"}, r"memory: '8 GB'.*'8Gi'"),
        ({"gpu": -1}, r"gpu: -1"),
        ({"gpu": 0, "mig": True}, r"gpu: 0 .*mig=True"),
        ({"version": "champion"}, r"version: 'champion'.*version number"),
        ({"host": "Digits.Example.com"}, r"host: 'Digits.Example.com'"),
        ({"image": "bad image"}, r"image: 'bad image'"),
    ],
)
def test_refuses_what_kubernetes_would(arguments: dict[str, Any], message: str) -> None:
    model = arguments.pop("model", "digits")
    with pytest.raises(ValueError, match=message):
        model_overlay(model, **arguments)


# --- the controller on the built manifests ----------------------------------------------------------------


def _apply(cluster: Cluster, model: str) -> None:
    """What `kubectl apply -k infra/k8s/models/<model>` leaves of the objects the controller touches."""
    objects = {(o["kind"], o["metadata"]["name"]): o for o in build_model("istio", model)}
    for track in (k8s.stable_name(model), k8s.canary_name(model)):
        AppsV1Api(cluster.client).create_namespaced_deployment(
            NS, V1Deployment.model_validate(objects["Deployment", track])
        )
    CoreV1Api(cluster.client).create_namespaced_service(NS, V1Service.model_validate(objects["Service", model]))
    for kind, plural in (("DestinationRule", "destinationrules"), ("VirtualService", "virtualservices")):
        CustomObjectsApi(cluster.client).create_namespaced_custom_object(
            k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, NS, plural, objects[kind, model]
        )


def _state(cluster: Cluster, model: str) -> list[Any]:
    """The model's objects as written (the simulated kubelet writes Deployment status on its own)."""
    found = [
        cluster.deployment(k8s.stable_name(model)),
        cluster.deployment(k8s.canary_name(model)),
        cluster.get(ISTIO["virtualservices"], model),
        cluster.get(ISTIO["destinationrules"], model),
    ]
    return [{key: value for key, value in (obj or {}).items() if key != "status"} for obj in found]


def test_the_controller_rolls_one_model_out_and_leaves_the_other_alone(cluster: Cluster) -> None:
    for model in EXAMPLES:
        _apply(cluster, model)
    bystander = _state(cluster, "digits")
    platform = cluster.platform(istio=True)
    assert platform.state("pcb-classifier") == PlatformState("pcb-classifier", "3", None, 0)
    assert platform.state("digits") == PlatformState("digits", "1", None, 0)

    assert platform.start_canary("pcb-classifier", "4") == PlatformState("pcb-classifier", "3", "4", 0)
    assert platform.set_weight("pcb-classifier", 50) == PlatformState("pcb-classifier", "3", "4", 50)
    service = cluster.get(ISTIO["virtualservices"], "pcb-classifier")
    assert service is not None and len(service["spec"]["http"]) == 1, "the manifest's route, not a second one"
    assert k8s.virtual_service_weight(service, "pcb-classifier") == 50
    promoted = platform.promote("pcb-classifier")
    assert promoted == PlatformState("pcb-classifier", "4", None, 0, previous_stable_version="3")

    stable = cluster.deployment(k8s.stable_name("pcb-classifier"))
    assert stable is not None
    env = {e["name"]: e.get("value") for e in stable["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[k8s.REPOSITORY_ENV] == "models:/pcb-classifier/4"
    assert _state(cluster, "digits") == bystander
