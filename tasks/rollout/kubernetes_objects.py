"""What the Kubernetes platform writes and how it reads it back: names, labels, annotations, object
builders, patch bodies, replica splits and rollout status. Pure functions, no API calls, so the rules are
tested without a cluster and ``kubernetes.py`` only sequences calls.

Every patch built here is sent as a JSON merge patch (``application/merge-patch+json``): the same body
means the same thing on the real API server, in the API simulator the tests use (which only merges), and
for Istio's custom resources (which have no strategic merge). Merge patches replace lists, so a patch
that changes a container carries the whole ``containers`` list read from the object; that is also a
valid strategic merge patch with the same result, because the list keeps every container by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from kubernetes.client import (
    V1Container,
    V1Deployment,
    V1DeploymentSpec,
    V1EnvVar,
    V1LabelSelector,
    V1ObjectMeta,
    V1PodSpec,
    V1PodTemplateSpec,
)

from tasks.rollout.platform import PlatformError

NAME_LABEL = "app.kubernetes.io/name"
TRACK_LABEL = "sluicegate.io/track"
VERSION_KEY = "sluicegate.io/model-version"  # label on Deployment and pods, annotation on pods
PREVIOUS_VERSION = "sluicegate.io/previous-version"  # stable: what it ran before the last promotion
PROMOTION = "sluicegate.io/promotion"  # stable: "in-progress" from the version patch until promote returns
PROMOTION_IN_PROGRESS = "in-progress"
TOTAL_REPLICAS = "sluicegate.io/total-replicas"  # canary: the replicas both tracks share, set at start
CANARY_WEIGHT = "sluicegate.io/canary-weight"  # canary, plain mode: the weight last set (source of truth)
REPOSITORY_ENV = "SLUICEGATE_SERVING__REPOSITORY"  # the serving container's model setting

ISTIO_GROUP = "networking.istio.io"
ISTIO_VERSION = "v1"
STABLE, CANARY = "stable", "canary"


def stable_name(model: str) -> str:
    return f"{model}-{STABLE}"


def canary_name(model: str) -> str:
    return f"{model}-{CANARY}"


# --- reading Deployments -------------------------------------------------------------------------------


def annotation(deployment: V1Deployment, key: str) -> str | None:
    metadata = deployment.metadata
    return (metadata.annotations or {}).get(key) if metadata is not None else None


def replicas(deployment: V1Deployment) -> int:
    """``spec.replicas``; the API server defaults an unset value to 1."""
    spec = deployment.spec
    return 1 if spec is None or spec.replicas is None else spec.replicas


def pod_template(deployment: V1Deployment) -> V1PodTemplateSpec:
    if deployment.spec is None:
        raise PlatformError(f"Deployment {_name(deployment)} has no spec; re-apply it from infra/k8s.")
    return deployment.spec.template


def deployment_version(deployment: V1Deployment) -> str | None:
    """The model version a Deployment serves: the pod-template annotation, else the pod or Deployment
    label (all three are written together; a hand-written manifest may carry only a label)."""
    template_meta = pod_template(deployment).metadata or V1ObjectMeta()
    for found in (
        (template_meta.annotations or {}).get(VERSION_KEY),
        (template_meta.labels or {}).get(VERSION_KEY),
        ((deployment.metadata or V1ObjectMeta()).labels or {}).get(VERSION_KEY),
    ):
        if found:
            return found
    return None


def total_replicas(stable: V1Deployment, canary: V1Deployment | None) -> int:
    """The replicas the two tracks share: the canary's record of it, else stable's (+ an unrecorded
    canary's). Recorded once so the split of every later step starts from the same total."""
    if canary is not None:
        recorded = annotation(canary, TOTAL_REPLICAS)
        if recorded is not None and recorded.isdigit():
            return max(1, int(recorded))
    return max(1, replicas(stable) + (replicas(canary) if canary is not None else 0))


def is_live_canary(canary: V1Deployment | None) -> TypeGuard[V1Deployment]:
    """Whether a canary Deployment is part of a rollout: it has pods, or ``start_canary``'s record (a
    plain-mode canary starts at 0 replicas). An idle one at 0 replicas without the record (one a
    rollback was removing, or a manifest's placeholder) is no canary."""
    return canary is not None and (replicas(canary) > 0 or annotation(canary, TOTAL_REPLICAS) is not None)


def plain_weight(stable: V1Deployment | None, canary: V1Deployment | None) -> int:
    """The canary's share without Istio: the recorded weight, else the replica ratio."""
    if canary is None:
        return 0
    recorded = annotation(canary, CANARY_WEIGHT)
    if recorded is not None and recorded.isdigit():
        return int(recorded)
    on_canary = replicas(canary)
    on_stable = replicas(stable) if stable is not None else 0
    return round(100 * on_canary / (on_canary + on_stable)) if on_canary else 0


def rollout_progress(deployment: V1Deployment) -> str | None:
    """What ``kubectl rollout status`` still waits for, or None when the rollout is complete: the
    controller has seen the latest spec, every replica runs it, no old replica is left, all available."""
    want = replicas(deployment)
    generation = (deployment.metadata.generation if deployment.metadata else None) or 0
    status = deployment.status
    observed = (status.observed_generation if status else None) or 0
    if observed < generation:
        return (
            f"the controller has not observed the change yet (observedGeneration {observed} < generation {generation})"
        )
    updated = (status.updated_replicas if status else None) or 0
    current = (status.replicas if status else None) or 0
    available = (status.available_replicas if status else None) or 0
    if updated < want:
        return f"{updated} of {want} replicas updated"
    if current > updated:
        return f"{current - updated} old replicas still terminating"
    if available < want:
        return f"{available} of {want} updated replicas available (Ready)"
    return None


def progress_deadline_exceeded(deployment: V1Deployment) -> str | None:
    """The controller's own verdict that the rollout is stuck (``progressDeadlineSeconds``), once it has
    observed the latest spec (an older verdict may be about the change before)."""
    status = deployment.status
    generation = (deployment.metadata.generation if deployment.metadata else None) or 0
    if status is None or (status.observed_generation or 0) < generation:
        return None
    for condition in (status.conditions if status else None) or []:
        if condition.type == "Progressing" and condition.reason == "ProgressDeadlineExceeded":
            return condition.message or "ProgressDeadlineExceeded"
    return None


# --- writing Deployments -------------------------------------------------------------------------------


def with_repository(containers: list[V1Container], container: str, uri: str, owner: str) -> list[V1Container]:
    """A copy of ``containers`` whose serving container has ``REPOSITORY_ENV=uri`` (replaced in place,
    other variables kept). The serving container is the one named ``container``, else the only one."""
    copies = [c.model_copy(deep=True) for c in containers]
    named = [c for c in copies if c.name == container]
    if not named and len(copies) == 1:
        named = copies
    if not named:
        names = ", ".join(c.name for c in copies) or "none"
        raise PlatformError(
            f"Deployment {owner} has no container named {container!r} (containers: {names}); name the "
            "serving container so in infra/k8s or construct KubernetesPlatform(container=...)."
        )
    target = named[0]
    env = list(target.env or [])
    setting = V1EnvVar(name=REPOSITORY_ENV, value=uri)
    positions = [i for i, var in enumerate(env) if var.name == REPOSITORY_ENV]
    if positions:
        env[positions[0]] = setting
    else:
        env.append(setting)
    target.env = env
    return copies


def canary_deployment(
    stable: V1Deployment,
    model: str,
    version: str,
    *,
    uri: str,
    container: str,
    replicas: int,
    annotations: Mapping[str, str],
) -> V1Deployment:
    """``<model>-canary``: stable's spec and pod template (probes, resources, GPUs, volumes) with the
    canary track and ``version``'s setting. Its selector is the name and track labels only, so it never
    overlaps stable's (which should select ``track: stable``) while the Service, selecting the name,
    sees both."""
    template = pod_template(stable).model_copy(deep=True)
    meta = template.metadata or V1ObjectMeta()
    meta.labels = {**(meta.labels or {}), NAME_LABEL: model, TRACK_LABEL: CANARY, VERSION_KEY: version}
    meta.annotations = {**(meta.annotations or {}), VERSION_KEY: version}
    template.metadata = meta
    pod_spec = template.spec or V1PodSpec(containers=[])
    pod_spec.containers = with_repository(pod_spec.containers, container, uri, _name(stable))
    template.spec = pod_spec
    spec = (stable.spec or V1DeploymentSpec(selector=V1LabelSelector(), template=template)).model_copy(deep=True)
    spec.replicas = replicas
    spec.paused = None
    spec.selector = V1LabelSelector(match_labels={NAME_LABEL: model, TRACK_LABEL: CANARY})
    spec.template = template
    stable_meta = stable.metadata or V1ObjectMeta()
    return V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=V1ObjectMeta(
            name=canary_name(model),
            namespace=stable_meta.namespace,
            labels={**(stable_meta.labels or {}), NAME_LABEL: model, TRACK_LABEL: CANARY, VERSION_KEY: version},
            annotations=dict(annotations),
        ),
        spec=spec,
    )


def canary_patch(desired: V1Deployment) -> dict[str, Any]:
    """Turn an existing canary (left by a crashed run) into ``desired``; the selector is immutable and
    always the same, so it is left out."""
    assert desired.metadata is not None and desired.spec is not None  # built by canary_deployment
    return {
        "metadata": {"labels": desired.metadata.labels, "annotations": desired.metadata.annotations},
        "spec": {"replicas": desired.spec.replicas, "template": desired.spec.template},
    }


def version_patch(
    deployment: V1Deployment,
    version: str,
    *,
    uri: str,
    container: str,
    annotations: Mapping[str, str | None] | None = None,
    replicas: int | None = None,
) -> dict[str, Any]:
    """Move a Deployment's pods to ``version`` (a rolling update): the serving setting, the version
    label and annotation; with ``annotations`` (None removes one) and ``replicas`` in the same patch,
    so the record and the change land together."""
    pod_spec = pod_template(deployment).spec or V1PodSpec(containers=[])
    containers = with_repository(pod_spec.containers, container, uri, _name(deployment))
    body: dict[str, Any] = {
        "metadata": {"labels": {VERSION_KEY: version}},
        "spec": {
            "template": {
                "metadata": {"labels": {VERSION_KEY: version}, "annotations": {VERSION_KEY: version}},
                "spec": {"containers": containers},
            }
        },
    }
    if annotations:
        body["metadata"]["annotations"] = dict(annotations)
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    return body


def scale_patch(replicas: int, annotations: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """``spec.replicas`` on the Deployment itself (no ``/scale`` subresource, so the Role needs no
    extra rule), with annotations recorded in the same write."""
    body: dict[str, Any] = {"spec": {"replicas": replicas}}
    if annotations:
        body["metadata"] = {"annotations": dict(annotations)}
    return body


def replica_split(total: int, canary_percent: int) -> tuple[int, int]:
    """(stable, canary) replicas for a split without a mesh, where the Service balances over Ready pods
    so the canary's share is its share of the pods. The canary gets the nearest count (half up), at
    least 1 for any weight above 0; stable keeps at least 1 until 100%, so a low total rounds towards
    the canary rather than to an empty stable."""
    if canary_percent <= 0:
        return total, 0
    if canary_percent >= 100:
        return 0, total
    canary = min(total, max(1, (total * canary_percent + 50) // 100))
    return max(1, total - canary), canary


def istio_canary_replicas(total: int, canary_percent: int) -> int:
    """Canary replicas with Istio, where weights do not depend on pods: enough pods for the share it
    is sent (rounded up), and 1 at 0% so the next step does not wait for a cold start."""
    return max(1, -(-total * canary_percent // 100))


# --- Istio ---------------------------------------------------------------------------------------------


def destination_rule(model: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{ISTIO_GROUP}/{ISTIO_VERSION}",
        "kind": "DestinationRule",
        "metadata": {"name": model, "labels": {NAME_LABEL: model}},
        "spec": {"host": model, "subsets": track_subsets([])},
    }


def track_subsets(existing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``existing`` subsets with ``stable`` and ``canary`` set to the track labels (others kept)."""
    ours = [{"name": track, "labels": {TRACK_LABEL: track}} for track in (STABLE, CANARY)]
    return [s for s in existing if s.get("name") not in (STABLE, CANARY)] + ours


def virtual_service(model: str, canary_percent: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{ISTIO_GROUP}/{ISTIO_VERSION}",
        "kind": "VirtualService",
        "metadata": {"name": model, "labels": {NAME_LABEL: model}},
        "spec": {"hosts": [model], "http": weighted_http([], model, canary_percent)},
    }


def _routes_to(entry: Mapping[str, Any], model: str) -> bool:
    hosts = [str(route.get("destination", {}).get("host", "")) for route in entry.get("route", [])]
    return bool(hosts) and all(host == model or host.startswith(f"{model}.") for host in hosts)


def weighted_http(http: list[dict[str, Any]], model: str, canary_percent: int) -> list[dict[str, Any]]:
    """The VirtualService's ``http`` list with every route to the model's Service split stable/canary;
    other keys of those routes (match, retries, timeout, port) and routes elsewhere are kept. Without
    one, a single default route is added."""
    entries = [dict(entry) for entry in http]
    managed = [entry for entry in entries if _routes_to(entry, model)]
    if not managed:
        entries.append({"route": [{"destination": {"host": model}}]})
        managed = entries[-1:]
    for entry in managed:
        base = dict(entry["route"][0].get("destination", {}))
        entry["route"] = [
            {"destination": {**base, "subset": STABLE}, "weight": 100 - canary_percent},
            {"destination": {**base, "subset": CANARY}, "weight": canary_percent},
        ]
    return entries


def virtual_service_weight(virtual_service: Mapping[str, Any], model: str) -> int:
    """The canary's percent in the first route to the model's Service (0 where there is none)."""
    for entry in virtual_service.get("spec", {}).get("http", []):
        if _routes_to(entry, model):
            routes = entry["route"]
            implied = 100 if len(routes) == 1 else 0  # Istio: a lone destination takes all
            return sum(
                int(route.get("weight", implied))
                for route in routes
                if route.get("destination", {}).get("subset") == CANARY
            )
    return 0


def _name(deployment: V1Deployment) -> str:
    metadata = deployment.metadata or V1ObjectMeta()
    return f"{metadata.namespace or ''}/{metadata.name or '?'}".lstrip("/")
