"""One model's Kubernetes overlay, ``infra/k8s/models/<model>/``: the files that serve a model with the
shared component ``infra/k8s/components/model`` (and ``istio``, ``mig``), its resources taken from the
model spec's ``serving`` group. Pure: it returns the files' text; writing them is the caller's.

The overlay holds only values: ``model.yaml`` (the model's name, first version and host, a local-config
ConfigMap that the components' replacements read and kustomize never emits) and ``kustomization.yaml``
(the components, the image, and patches for the pods' resources and the autoscaler's range). Every
object name comes out as ``tasks/rollout/kubernetes_objects.py`` derives it (``<model>-stable``,
``<model>-canary``, Service, DestinationRule and VirtualService ``<model>``), so the rollout controller
works on it unchanged. See ``infra/k8s/README.md``.
"""

from __future__ import annotations

import json
import re

from sluicegate.model_specs import CPU, MEMORY, MODEL_NAME

HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
VERSION = re.compile(r"^[1-9][0-9]*$")
IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?$")

DEFAULT_IMAGE = "ghcr.io/sluicegate/sluicegate-serving:0.1.0"
IMAGE_NAME = "sluicegate-serving"  # the image name the component's Deployments carry
GPU = "nvidia.com/gpu"
MIG_SLICE = "nvidia.com/mig-1g.10gb"  # the slice infra/k8s/components/mig asks for
NAMESPACE = "sluicegate-serving"


def model_overlay(
    model: str,
    *,
    replicas: int = 2,
    cpu: str = "1",
    memory: str = "1Gi",
    gpu: int = 0,
    image: str = DEFAULT_IMAGE,
    version: str = "1",
    max_replicas: int | None = None,
    host: str | None = None,
    istio: bool = True,
    mig: bool = False,
) -> dict[str, str]:
    """The files of ``infra/k8s/models/<model>/``, by file name.

    Args:
        model: the registered model's name; it names the Kubernetes objects.
        replicas: the stable Deployment's pods at least (the autoscaler's minimum).
        cpu: CPU request and limit per pod (a Kubernetes quantity: "2", "500m").
        memory: memory request and limit per pod ("8Gi").
        gpu: GPUs per pod, ``nvidia.com/gpu`` (with ``mig``, 1g.10gb MIG slices); 0: CPU only, and
            the pods no longer tolerate the GPU nodes' taint.
        image: the serving image, ``name:tag`` or ``name@sha256:...``.
        version: the model version stable serves at the first apply (then the rollout owns it).
        max_replicas: the autoscaler's maximum; default four times ``replicas``.
        host: the Ingress host name; default ``<model>.example.com``.
        istio: split traffic with Istio weights (with the shared ``overlays/istio``); False: by the
            replica ratio (with ``overlays/plain``). The same for every model of a cluster: it is the
            platform's rollout setting ``istio``, and sidecar injection is namespace-wide.
        mig: MIG slices instead of whole GPUs (``components/mig``).

    Returns:
        ``{"kustomization.yaml": ..., "model.yaml": ...}``, YAML text.

    Raises:
        ValueError: an argument Kubernetes would refuse or the components cannot render; the message
            names the argument, the value and the fix.
    """
    maximum = 4 * replicas if max_replicas is None else max_replicas
    host = host if host is not None else f"{model}.example.com"
    _check(model, replicas, maximum, cpu, memory, gpu, image, version, host, mig)
    return {
        "kustomization.yaml": _kustomization(model, replicas, maximum, cpu, memory, gpu, image, istio, mig),
        "model.yaml": _model_config(model, version, host),
    }


def _check(
    model: str,
    replicas: int,
    maximum: int,
    cpu: str,
    memory: str,
    gpu: int,
    image: str,
    version: str,
    host: str,
    mig: bool,
) -> None:
    if not MODEL_NAME.match(model):
        raise ValueError(
            f"model: {model!r} is not a valid model name for Kubernetes; use 1-40 lower-case letters, digits "
            "and '-', starting and ending with a letter or digit (a DNS-1123 label short enough for "
            "'<model>-canary' and its pods' names to fit 63 characters), e.g. 'pcb-classifier'."
        )
    problems = [
        (replicas < 1, "replicas", replicas, "at least 1"),
        (maximum < replicas, "max_replicas", maximum, f"at least replicas ({replicas})"),
        (not CPU.match(cpu), "cpu", cpu, "a CPU quantity such as '2', '1.5' or '500m'"),
        (not MEMORY.match(memory), "memory", memory, "a memory quantity such as '8Gi' or '512Mi'"),
        (gpu < 0, "gpu", gpu, "0 (CPU only) or more"),
        (mig and gpu < 1, "gpu", gpu, "at least 1 with mig=True (MIG slices per pod), or mig=False"),
        (not VERSION.match(version), "version", version, "an MLflow model version number such as '1'"),
        (not HOST_NAME.match(host), "host", host, "a lower-case DNS name such as 'digits.example.com'"),
        (not IMAGE.match(image), "image", image, "an image reference such as 'registry/name:tag'"),
    ]
    for failed, field, value, fix in problems:
        if failed:
            raise ValueError(f"{field}: {value!r} for model {model!r} is not valid; use {fix}.")


def _image(image: str) -> str:
    """The ``images:`` entry's fields for ``image`` (name:tag, name@digest, or a name alone)."""
    name, digest = image.split("@", 1) if "@" in image else (image, "")
    tag = ""
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    lines = [f"  - name: {IMAGE_NAME}", f"    newName: {name}"]
    if tag:
        lines.append(f"    newTag: {json.dumps(tag)}")
    if digest:
        lines.append(f"    digest: {digest}")
    return "\n".join(lines)


def _resources(cpu: str, memory: str, gpu: int, mig: bool) -> str:
    amounts = {"cpu": cpu, "memory": memory}
    if gpu:
        amounts[MIG_SLICE if mig else GPU] = str(gpu)
    # Quantities as strings, as the API server returns them (JSON strings are YAML strings).
    return "{" + ", ".join(f"{key}: {json.dumps(value)}" for key, value in amounts.items()) + "}"


def _kustomization(
    model: str, replicas: int, maximum: int, cpu: str, memory: str, gpu: int, image: str, istio: bool, mig: bool
) -> str:
    components = ["../../components/model"] + ["../../components/istio"] * istio + ["../../components/mig"] * mig
    shared = "istio" if istio else "plain"
    gpus = f"{gpu} MIG slice(s) 1g.10gb" if mig else f"{gpu} GPU(s)" if gpu else "no GPU"
    resources = _resources(cpu, memory, gpu, mig)
    untolerate = (
        ""
        if gpu
        else "\n      # CPU only: no toleration of the GPU nodes' taint, so the pods stay off GPU nodes.\n"
        "      - op: remove\n        path: /spec/template/spec/tolerations"
    )
    return f"""\
# Model {model}: its serving objects from ../../components/model{" with Istio's traffic split" * istio}.
# Generated by tasks/rollout/manifests.py model_overlay(); regenerate it, or edit it like any overlay.
# Goes with the shared objects of ../../overlays/{shared}, applied first (see ../../README.md):
#   kubectl apply -k infra/k8s/models/{model}
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization

namespace: {NAMESPACE}

# The model's name, first version and host, which the components put in (never applied itself).
resources:
  - model.yaml

components:
{chr(10).join(f"  - {c}" for c in components)}

images:
{_image(image)}

patches:
  # Per pod, requests = limits: {cpu} CPU, {memory} memory, {gpus}.
  - target:
      kind: Deployment
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/resources
        value:
          requests: {resources}
          limits: {resources}{untolerate}
  # Stable's pods; the HorizontalPodAutoscaler scales them (the rollout sizes the canary).
  - target:
      kind: HorizontalPodAutoscaler
    patch: |-
      - op: replace
        path: /spec/minReplicas
        value: {replicas}
      - op: replace
        path: /spec/maxReplicas
        value: {maximum}
"""


def _model_config(model: str, version: str, host: str) -> str:
    return f"""\
# Read by the replacements of ../../components/* (the placeholder "model" becomes these values) and,
# being local-config, never applied. The version is stable's at the first apply; afterwards the rollout
# controller owns it (re-applying an unchanged file does not undo a promotion).
apiVersion: v1
kind: ConfigMap
metadata:
  name: sluicegate-model
  annotations:
    config.kubernetes.io/local-config: "true"
data:
  name: {json.dumps(model)}
  version: {json.dumps(version)}
  host: {json.dumps(host)}
"""
