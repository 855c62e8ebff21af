"""Several models side by side in one cluster (infra/k8s/models/*): every object name is unique across
the stack, every selector selects its own model's pods only, no placeholder of the shared component is
left, the shared objects stay in the shared overlay, and the names and labels are the ones the rollout
controller derives (tasks/rollout/kubernetes_objects.py), so it works on them unchanged."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

import kubernetes_validate
import pytest
from kubernetes.client import V1Deployment

from tasks.rollout import kubernetes_objects as k8s
from tests.infra.k8s_manifests import (
    MODELS,
    STACKS,
    Obj,
    build,
    build_model,
    deployments,
    model_output,
    of_kind,
    one,
    parse,
    shared_output,
)

SHARED_KINDS = {"Namespace", "ServiceAccount", "Role", "RoleBinding"}
# Where each kind selects pods: (the field path, which pods it must select: "model" both tracks,
# "track" its own track only).
POD_SELECTORS = {
    "Service": (("spec", "selector"), "model"),
    "PodMonitor": (("spec", "selector", "matchLabels"), "model"),
    "PeerAuthentication": (("spec", "selector", "matchLabels"), "model"),
    "Deployment": (("spec", "selector", "matchLabels"), "track"),
    "PodDisruptionBudget": (("spec", "selector", "matchLabels"), "stable"),
}
# The annotations in the manifests that the controller reads (anything else under sluicegate.io/ would
# be state nobody keeps).
CONTROLLER_ANNOTATIONS = {k8s.CANARY_WEIGHT, k8s.PREVIOUS_VERSION, k8s.PROMOTION, k8s.TOTAL_REPLICAS, k8s.VERSION_KEY}


def _pods(objects: list[Obj]) -> list[tuple[str, dict[str, str]]]:
    """(Deployment name, pod labels) of every Deployment."""
    return [
        (d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"]) for d in of_kind(objects, "Deployment")
    ]


def _strings(value: object) -> Iterator[str]:
    """Every string value (not key) in ``value``."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _get(obj: Obj, path: tuple[str, ...]) -> dict[str, str]:
    for key in path:
        obj = obj[key]
    return obj


@pytest.mark.parametrize("stack", STACKS)
def test_no_two_objects_share_a_name(stack: str) -> None:
    names = Counter((obj["kind"], obj["metadata"]["name"]) for obj in build(stack))
    assert not [key for key, count in names.items() if count > 1]
    for model in MODELS:
        assert {obj["metadata"]["name"].split("-serving-")[0] for obj in build_model(stack, model)} <= {
            model,
            k8s.stable_name(model),
            k8s.canary_name(model),
        }, f"an object of {model} is not named after it"


@pytest.mark.parametrize("stack", STACKS)
def test_selectors_select_their_own_models_pods_only(stack: str) -> None:
    objects = build(stack)
    pods = _pods(objects)
    for model in MODELS:
        for obj in build_model(stack, model):
            if obj["kind"] not in POD_SELECTORS:
                continue
            path, scope = POD_SELECTORS[obj["kind"]]
            selector = _get(obj, path)
            selected = {name for name, labels in pods if selector.items() <= labels.items()}
            expected = {
                "model": {k8s.stable_name(model), k8s.canary_name(model)},
                "stable": {k8s.stable_name(model)},
                "track": {obj["metadata"]["name"]},
            }[scope]
            assert selected == expected, f"{obj['kind']}/{obj['metadata']['name']} selects {sorted(selected)}"
        for deployment in deployments(objects, model).values():
            for constraint in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]:
                selector = constraint["labelSelector"]["matchLabels"]
                selected = {name for name, labels in pods if selector.items() <= labels.items()}
                assert selected == {deployment["metadata"]["name"]}


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("model", MODELS)
def test_no_placeholder_is_left(stack: str, model: str) -> None:
    """The component names the model "model" and its version "1"; every such value is replaced (a
    replacement whose target is not found is skipped silently, so this is the check)."""
    placeholder = re.compile(r"^model([-.].*)?$|/model/")
    left = [value for value in _strings(build_model(stack, model)) if placeholder.search(value)]
    assert set(left) <= {"model-server"}, f"placeholder left in {model}'s overlay: {left}"
    assert "sluicegate-model" not in model_output(stack, model), "the local-config ConfigMap must not be applied"


@pytest.mark.parametrize("stack", STACKS)
def test_shared_objects_in_the_shared_overlay_only(stack: str) -> None:
    shared = parse(shared_output(stack))
    assert {obj["kind"] for obj in shared} == SHARED_KINDS
    assert {obj["metadata"]["name"] for obj in of_kind(shared, "ServiceAccount")} == {"sluicegate-rollout"}
    for model in MODELS:
        kinds = {obj["kind"] for obj in build_model(stack, model)}
        assert not kinds & {"Namespace", "Role", "RoleBinding"}, f"{model}'s overlay holds shared objects"


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("model", MODELS)
def test_names_and_labels_are_the_rollout_controllers(stack: str, model: str) -> None:
    objects = build_model(stack, model)
    stable = V1Deployment.model_validate(one(objects, "Deployment", k8s.stable_name(model)))
    idle = V1Deployment.model_validate(one(objects, "Deployment", k8s.canary_name(model)))
    one(objects, "Service", model)
    assert k8s.deployment_version(stable) == k8s.deployment_version(idle)
    assert not k8s.is_live_canary(idle), "the idle placeholder reads as no canary"
    assert k8s.plain_weight(stable, idle) == 0
    canary = k8s.canary_deployment(
        stable, model, "7", uri=f"models:/{model}/7", container="server", replicas=1, annotations={}
    )
    assert canary.metadata is not None and canary.spec is not None
    assert canary.metadata.name == k8s.canary_name(model)
    assert idle.spec is not None and canary.spec.selector == idle.spec.selector, "a selector is immutable"
    manifest = canary.model_dump(by_alias=True, exclude_none=True, mode="json")
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    for deployment in (stable, idle):
        annotations = {**(deployment.metadata.annotations or {})} if deployment.metadata else {}
        ours = {key for key in annotations if key.startswith("sluicegate.io/")}
        assert ours <= CONTROLLER_ANNOTATIONS, (
            f"annotations the controller does not read: {ours - CONTROLLER_ANNOTATIONS}"
        )


@pytest.mark.parametrize("model", MODELS)
def test_istio_objects_are_the_ones_the_controller_patches(model: str) -> None:
    objects = build_model("istio", model)
    rule = one(objects, "DestinationRule", k8s.destination_rule(model)["metadata"]["name"])
    assert rule["spec"]["subsets"] == k8s.track_subsets(rule["spec"]["subsets"])
    service = one(objects, "VirtualService", k8s.virtual_service(model, 0)["metadata"]["name"])
    assert k8s.virtual_service_weight(service, model) == 0
    http = k8s.weighted_http(service["spec"]["http"], model, 30)
    assert len(http) == len(service["spec"]["http"]), "the controller must find the manifest's route, not add one"
    assert k8s.virtual_service_weight({"spec": {"http": http}}, model) == 30
    for other in set(MODELS) - {model}:
        theirs = k8s.weighted_http(service["spec"]["http"], other, 30)
        assert theirs[: len(service["spec"]["http"])] == service["spec"]["http"], f"{other} would move {model}'s split"
