"""The Kubernetes rollout platform: a canary Deployment beside the stable one, traffic split by Istio
weights or, without a mesh, by replica counts behind one Service (DESIGN section 7).

Objects, as ``infra/k8s`` names them (namespace ``sluicegate-serving`` by default): Deployments
``<model>-stable`` and ``<model>-canary`` labelled ``app.kubernetes.io/name``, ``sluicegate.io/track``
and ``sluicegate.io/model-version``; a Service ``<model>`` selecting the name label only, so it balances
over both tracks; with Istio a DestinationRule ``<model>`` (subsets by track) and a VirtualService
``<model>`` (the weights). The version is the serving container's ``SLUICEGATE_SERVING__REPOSITORY``.

Where a rollout stands lives on the objects (annotations, see ``kubernetes_objects``), never in this
process, so a fresh platform object continues where a crashed one stopped and every call converges
when repeated. There are no ReplicaSet revisions involved: rolling back means patching the pod
template to the previous version, which on a real cluster reuses the previous ReplicaSet anyway.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import urllib3
from kubernetes.client import ApiClient, ApiException, AppsV1Api, CoreV1Api, CustomObjectsApi, V1Deployment

from tasks.rollout import kubernetes_objects as k8s
from tasks.rollout.platform import PlatformError, PlatformState

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

MERGE_PATCH = "application/merge-patch+json"  # see kubernetes_objects: one meaning everywhere
DEFAULT_NAMESPACE = "sluicegate-serving"
_RBAC_FIX = (
    "grant it in the rollout controller's Role (infra/k8s, rollout-rbac.yaml): get/create/patch/delete "
    "on deployments, get on services, and with Istio get/create/patch on destinationrules and "
    "virtualservices (networking.istio.io), bound to the service account this runs as"
)


def api_client_from_environment(config_file: str | None = None, context: str | None = None) -> ApiClient:
    """An API client for wherever this runs: the pod's service account inside a cluster, else a
    kubeconfig (``config_file``, by default ``KUBECONFIG`` or ``~/.kube/config``; ``context``, by
    default its current one). Loaded into a client of its own rather than the library's global default,
    so nothing else in the process is affected.

    Raises:
        PlatformError: neither is available.
    """
    from kubernetes import config
    from kubernetes.client import Configuration

    configuration = Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        try:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=config_file, context=context, client_configuration=configuration, persist_config=False
            )
        except (config.ConfigException, OSError) as exc:
            raise PlatformError(
                f"no Kubernetes credentials: not in a pod with a service account, and no usable kubeconfig "
                f"({exc}); set KUBECONFIG or run inside the cluster."
            ) from exc
    return ApiClient(configuration)


def _status_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


def _api_error(exc: ApiException, verb: str, what: str) -> PlatformError:
    """An API error as a PlatformError naming the object, the HTTP status and the fix."""
    message = _status_message(exc)
    fixes = {
        401: "the API server rejected the credentials; refresh the kubeconfig or the service-account token",
        403: f"the service account may not {verb} it; {_RBAC_FIX}",
        404: "it is gone (deleted meanwhile?) or the API server does not serve its kind (Istio's CRDs missing? "
        "then install Istio or use istio=False)",
        409: "it was changed concurrently; re-run the step (every step is idempotent)",
        422: "the API server rejected the object as invalid; fix the manifest in infra/k8s it was copied from",
    }
    fix = fixes.get(exc.status or 0, "see the API server's message")
    return PlatformError(f"{verb} {what}: HTTP {exc.status} {exc.reason} ({message}); {fix}.")


@dataclass(frozen=True)
class _Resize:
    """One Deployment's replicas, from ``current`` to ``target``, with annotations recorded alongside."""

    name: str
    current: int
    target: int
    annotations: Mapping[str, str | None] = field(default_factory=dict)


class KubernetesPlatform:
    """Canary rollouts on Kubernetes: Istio weights with ``istio=True``, else a replica-ratio split.

    Without Istio the Service balances over every Ready pod of both tracks, so a Ready canary pod
    takes a share at once. ``start_canary`` therefore creates the canary with 0 replicas (the contract's
    "0% of the traffic" holds; its readiness is proved by the first ``set_weight``, which scales it up
    and waits for it before stable scales down, and raises if it never becomes Ready, leaving rollback
    to the flow). ``set_weight(p)`` splits the total T recorded at start: canary ``round(T*p/100)``
    (at least 1 above 0%), stable the rest (at least 1 below 100%); the weight actually served is that
    pod ratio, the weight asked for is recorded for ``state``. T is stable's replicas at start, so an
    autoscaler on stable would fight this split: keep it off (or use Istio) while a rollout runs.

    With Istio the canary starts with 1 Ready replica at 0% (the mesh keeps it out of traffic), is
    scaled to ``ceil(T*p/100)`` before its weight rises, and stable keeps T replicas throughout, so a
    rollback is one VirtualService patch.

    Args:
        api_client: a configured client (``api_client_from_environment()``, or one pointed at a test
            API server).
        namespace: where the model's objects live.
        istio: split traffic with a VirtualService instead of replica counts.
        repository_uri: the serving setting for a version: a format string with ``{model}`` and
            ``{version}``, or a callable ``(model, version) -> str`` (where the registered model's name
            differs from the Kubernetes name).
        container: the serving container's name, as infra/k8s names it (a single-container pod's only
            container is taken whatever its name).
        ready_timeout_s: how long a Deployment may take to finish a rollout (image pull, GPU scheduling,
            engine warm-up) before a step fails.
        poll_interval_s: how often its status is read meanwhile.
    """

    name = "kubernetes"

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        istio: bool = False,
        repository_uri: str | Callable[[str, str], str] = "models:/{model}/{version}",
        container: str = "server",
        ready_timeout_s: float = 600.0,
        poll_interval_s: float = 2.0,
    ) -> None:
        self._apps = AppsV1Api(api_client)
        self._core = CoreV1Api(api_client)
        self._custom = CustomObjectsApi(api_client)
        self.namespace = namespace
        self.istio = istio
        self._repository_uri = repository_uri
        self._container = container
        self._ready_timeout_s = ready_timeout_s
        self._poll_interval_s = poll_interval_s

    # --- the protocol --------------------------------------------------------------------------------

    def state(self, model: str) -> PlatformState:
        stable = self._read_deployment(k8s.stable_name(model))
        canary = self._read_deployment(k8s.canary_name(model))
        if self.istio:
            virtual_service = self._read_istio("virtualservices", model)
            weight = k8s.virtual_service_weight(virtual_service, model) if virtual_service else 0
        else:
            weight = k8s.plain_weight(stable, canary)
        return PlatformState(
            model=model,
            stable_version=k8s.deployment_version(stable) if stable is not None else None,
            canary_version=k8s.deployment_version(canary) if k8s.is_live_canary(canary) else None,
            canary_weight=weight,
            previous_stable_version=k8s.annotation(stable, k8s.PREVIOUS_VERSION) if stable is not None else None,
        )

    def start_canary(self, model: str, version: str) -> PlatformState:
        stable = self._require_stable(model)
        self._check_service(model)
        if k8s.annotation(stable, k8s.PROMOTION) == k8s.PROMOTION_IN_PROGRESS:
            raise PlatformError(
                f"Deployment {self._where(k8s.stable_name(model))} is in the middle of a promotion "
                f"({k8s.PROMOTION}={k8s.PROMOTION_IN_PROGRESS}); finish it with promote or undo it with rollback first."
            )
        existing = self._read_deployment(k8s.canary_name(model))
        total = k8s.total_replicas(stable, existing)
        if existing is not None:  # from a crashed run, maybe of another version: traffic off it first
            self._traffic_to_stable(model, stable, existing, total)
        annotations = {k8s.TOTAL_REPLICAS: str(total)}
        if not self.istio:
            annotations[k8s.CANARY_WEIGHT] = "0"
        desired = k8s.canary_deployment(
            stable,
            model,
            version,
            uri=self._uri(model, version),
            container=self._container,
            replicas=1 if self.istio else 0,
            annotations=annotations,
        )
        self._create_or_patch_canary(desired)
        if self.istio:
            self._ensure_destination_rule(model)
            self._set_istio_weight(model, 0)
        self._wait_ready(k8s.canary_name(model))
        logger.info("canary %s of %s started (%d total replicas)", version, model, total)
        return self.state(model)

    def set_weight(self, model: str, canary_percent: int) -> PlatformState:
        if not 0 <= canary_percent <= 100:
            raise ValueError(f"canary_percent must be 0..100, got {canary_percent}")
        stable = self._require_stable(model)
        canary = self._read_deployment(k8s.canary_name(model))
        if canary is None:
            raise PlatformError(
                f"no canary Deployment {self._where(k8s.canary_name(model))} to send traffic to; "
                "call start_canary first."
            )
        total = k8s.total_replicas(stable, canary)
        on_canary = k8s.replicas(canary)
        if self.istio:
            target = k8s.istio_canary_replicas(total, canary_percent)
            resizes = [_Resize(k8s.canary_name(model), on_canary, target)]
            self._resize(resizes, between=lambda: self._set_istio_weight(model, canary_percent))
        else:
            on_stable, target = k8s.replica_split(total, canary_percent)
            weight = {k8s.CANARY_WEIGHT: str(canary_percent)}
            self._resize(
                [
                    _Resize(k8s.stable_name(model), k8s.replicas(stable), on_stable),
                    _Resize(k8s.canary_name(model), on_canary, target, weight),
                ]
            )
        logger.info("%s: %d%% on the canary", model, canary_percent)
        return self.state(model)

    def promote(self, model: str) -> PlatformState:
        stable = self._require_stable(model)
        canary = self._read_deployment(k8s.canary_name(model))
        in_progress = k8s.annotation(stable, k8s.PROMOTION) == k8s.PROMOTION_IN_PROGRESS
        current = k8s.deployment_version(stable)
        target = k8s.deployment_version(canary) if canary is not None else (current if in_progress else None)
        if target is None:
            logger.info("%s: no canary and no unfinished promotion; nothing to promote", model)
            return self.state(model)
        total = k8s.total_replicas(stable, canary)
        name = k8s.stable_name(model)
        if current != target:
            # One patch records the way back and moves stable, so no crash can separate the two.
            record = {k8s.PREVIOUS_VERSION: current, k8s.PROMOTION: k8s.PROMOTION_IN_PROGRESS}
            uri = self._uri(model, target)
            patch = k8s.version_patch(
                stable, target, uri=uri, container=self._container, annotations=record, replicas=total
            )
            self._patch_deployment(name, patch)
        elif k8s.replicas(stable) != total:
            self._patch_deployment(name, k8s.scale_patch(total))
        self._wait_ready(name)
        if self.istio:
            self._set_istio_weight(model, 0, only_if_exists=True)
        self._delete_deployment(k8s.canary_name(model))
        self._patch_deployment(name, {"metadata": {"annotations": {k8s.PROMOTION: None}}})
        logger.info("%s: promoted %s (was %s)", model, target, current)
        return self.state(model)

    def rollback(self, model: str) -> PlatformState:
        stable = self._require_stable(model)
        canary = self._read_deployment(k8s.canary_name(model))
        name = k8s.stable_name(model)
        unfinished = k8s.annotation(stable, k8s.PROMOTION) == k8s.PROMOTION_IN_PROGRESS
        if self.istio:
            self._set_istio_weight(model, 0, only_if_exists=True)  # traffic first: one patch, no wait
        if unfinished:  # before anything waits on stable: its rollout to the new version may be what is stuck
            self._revert_promotion(model, stable)
        if not self.istio:
            self._traffic_to_stable(model, stable, canary, k8s.total_replicas(stable, canary))
        self._wait_ready(name)
        self._delete_deployment(k8s.canary_name(model))
        if unfinished:
            self._patch_deployment(name, {"metadata": {"annotations": {k8s.PROMOTION: None}}})
        logger.info("%s: rolled back to stable", model)
        return self.state(model)

    # --- steps ---------------------------------------------------------------------------------------

    def _revert_promotion(self, model: str, stable: V1Deployment) -> None:
        """Put stable back on the version it ran before a promotion that never returned (this
        platform's ``kubectl rollout undo``) by patching the template back rather than rolling back to
        a ReplicaSet revision: revisions are the controller's bookkeeping, which the API emulator the
        tests use does not have, and on a real cluster a template equal to the previous one makes the
        Deployment controller scale the previous ReplicaSet back up, which is all undo does."""
        previous = k8s.annotation(stable, k8s.PREVIOUS_VERSION)
        if previous is None:
            logger.warning("%s: stable records no previous version; it stays on its current one", model)
        elif previous != k8s.deployment_version(stable):
            uri = self._uri(model, previous)
            patch = k8s.version_patch(stable, previous, uri=uri, container=self._container)
            self._patch_deployment(k8s.stable_name(model), patch)
            logger.info("%s: unfinished promotion undone, stable back on %s", model, previous)

    def _traffic_to_stable(self, model: str, stable: V1Deployment, canary: V1Deployment | None, total: int) -> None:
        """100% on stable: the VirtualService, or stable back to T Ready replicas before the canary
        goes to 0 and drops its rollout record (so it reads as no canary if deleting it never happens)."""
        if self.istio:
            self._set_istio_weight(model, 0, only_if_exists=True)
            return
        resizes = [_Resize(k8s.stable_name(model), k8s.replicas(stable), total)]
        if canary is not None:
            retire = {k8s.CANARY_WEIGHT: None, k8s.TOTAL_REPLICAS: None}
            resizes.append(_Resize(k8s.canary_name(model), k8s.replicas(canary), 0, retire))
        self._resize(resizes)

    def _resize(self, resizes: list[_Resize], between: Callable[[], None] | None = None) -> None:
        """Scale-ups first, each waited for until Ready, then ``between`` (a weight change), then the
        scale-downs: serving capacity never drops below what the traffic about to arrive needs. Every
        Deployment is patched and waited for even when its count is already right, so a call repeated
        after a crash mid-rollout still waits for it."""
        ups = [r for r in resizes if r.target > r.current]
        downs = [r for r in resizes if r.target <= r.current]
        for resize in ups:
            self._scale(resize)
        if between is not None:
            between()
        for resize in downs:
            self._scale(resize)

    def _scale(self, resize: _Resize) -> None:
        self._patch_deployment(resize.name, k8s.scale_patch(resize.target, resize.annotations))
        self._wait_ready(resize.name)

    def _ensure_destination_rule(self, model: str) -> None:
        existing = self._read_istio("destinationrules", model)
        if existing is None:
            self._create_istio("destinationrules", k8s.destination_rule(model))
            return
        subsets = existing.get("spec", {}).get("subsets", [])
        wanted = k8s.track_subsets(subsets)
        if wanted != subsets:
            self._patch_istio("destinationrules", model, {"spec": {"subsets": wanted}})

    def _set_istio_weight(self, model: str, canary_percent: int, *, only_if_exists: bool = False) -> None:
        existing = self._read_istio("virtualservices", model)
        if existing is None:
            if not only_if_exists:
                self._create_istio("virtualservices", k8s.virtual_service(model, canary_percent))
            return
        http = existing.get("spec", {}).get("http", [])
        wanted = k8s.weighted_http(http, model, canary_percent)
        if wanted != http:
            self._patch_istio("virtualservices", model, {"spec": {"http": wanted}})

    def _wait_ready(self, name: str) -> None:
        """Poll until the Deployment's rollout is complete (``kubectl rollout status``)."""
        deadline = time.monotonic() + self._ready_timeout_s
        while True:
            deployment = self._read_deployment(name)
            if deployment is None:
                raise PlatformError(f"Deployment {self._where(name)} disappeared while waiting for it to be ready.")
            missing = k8s.rollout_progress(deployment)
            if missing is None:
                return
            stuck = k8s.progress_deadline_exceeded(deployment)
            if stuck is not None or time.monotonic() >= deadline:
                why = f"not ready after {self._ready_timeout_s:g}s"
                if stuck is not None:
                    why = f"its progress deadline passed ({stuck})"
                raise PlatformError(
                    f"Deployment {self._where(name)}: {why}: {missing}. See `kubectl -n {self.namespace} describe "
                    f"deployment {name}` and its pods' events (image pull, GPU scheduling, the /health/ready probe); "
                    "raise ready_timeout_s if the engine warm-up is just slow."
                )
            time.sleep(self._poll_interval_s)

    def _check_service(self, model: str) -> None:
        """The Service must select both tracks, or the canary would get no traffic whatever the
        weights say (Istio's subsets only divide the Service's endpoints)."""
        read = self._core.read_namespaced_service
        service = self._call("get", f"Service {self._where(model)}", lambda: read(model, self.namespace), absent=404)
        if service is None:
            raise PlatformError(f"no Service {self._where(model)}: apply the model's manifests in infra/k8s first.")
        selector = (service.spec.selector if service.spec else None) or {}
        if k8s.TRACK_LABEL in selector or selector.get(k8s.NAME_LABEL) != model:
            raise PlatformError(
                f"Service {self._where(model)} selects {selector}; it must select {k8s.NAME_LABEL}: {model} "
                f"and not {k8s.TRACK_LABEL}, so that it reaches the canary's pods too."
            )

    # --- API calls, each mapped to PlatformError -----------------------------------------------------

    def _require_stable(self, model: str) -> V1Deployment:
        stable = self._read_deployment(k8s.stable_name(model))
        if stable is None:
            raise PlatformError(
                f"no stable Deployment {self._where(k8s.stable_name(model))}: apply the model's manifests "
                "in infra/k8s first (the platform rolls versions, it does not create the model's stack)."
            )
        return stable

    def _read_deployment(self, name: str) -> V1Deployment | None:
        return self._call(
            "get",
            f"Deployment {self._where(name)}",
            lambda: self._apps.read_namespaced_deployment(name, self.namespace),
            absent=404,
        )

    def _patch_deployment(self, name: str, body: dict[str, Any]) -> None:
        self._call(
            "patch",
            f"Deployment {self._where(name)}",
            lambda: self._apps.patch_namespaced_deployment(name, self.namespace, body, _content_type=MERGE_PATCH),
        )

    def _delete_deployment(self, name: str) -> None:
        self._call(
            "delete",
            f"Deployment {self._where(name)}",
            lambda: self._apps.delete_namespaced_deployment(name, self.namespace, propagation_policy="Background"),
            absent=404,
        )

    def _create_or_patch_canary(self, desired: V1Deployment) -> None:
        assert desired.metadata is not None and desired.metadata.name is not None  # canary_deployment's
        name = desired.metadata.name

        def create() -> bool:
            self._apps.create_namespaced_deployment(self.namespace, desired)
            return True

        if self._call("create", f"Deployment {self._where(name)}", create, absent=409) is None:
            self._patch_deployment(name, k8s.canary_patch(desired))  # left by a crashed run: make it this one

    def _read_istio(self, plural: str, name: str) -> dict[str, Any] | None:
        def get() -> dict[str, Any]:
            found = self._custom.get_namespaced_custom_object(
                k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, self.namespace, plural, name
            )
            return cast(dict[str, Any], found)

        return self._call("get", f"{plural} {self._where(name)}", get, absent=404)

    def _create_istio(self, plural: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]

        def create() -> bool:
            self._custom.create_namespaced_custom_object(
                k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, self.namespace, plural, body
            )
            return True

        if self._call("create", f"{plural} {self._where(name)}", create, absent=409) is None:
            self._patch_istio(plural, name, {"spec": body["spec"]})  # created meanwhile: make it ours

    def _patch_istio(self, plural: str, name: str, body: dict[str, Any]) -> None:
        self._call(
            "patch",
            f"{plural} {self._where(name)}",
            lambda: self._custom.patch_namespaced_custom_object(
                k8s.ISTIO_GROUP, k8s.ISTIO_VERSION, self.namespace, plural, name, body, _content_type=MERGE_PATCH
            ),
        )

    def _call(self, verb: str, what: str, call: Callable[[], _T], *, absent: int | None = None) -> _T | None:
        """``call()``, its API errors as PlatformError naming ``verb`` and ``what``; None where the API
        answered ``absent`` (404 on a read or delete: not there; 409 on a create: already there)."""
        try:
            return call()
        except ApiException as exc:
            if absent is not None and exc.status == absent:
                return None
            raise _api_error(exc, verb, what) from exc
        except urllib3.exceptions.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: Exception) -> PlatformError:
        host = self._apps.api_client.configuration.host
        return PlatformError(f"cannot reach the Kubernetes API at {host} ({exc}); check the kubeconfig context.")

    # --- small helpers -------------------------------------------------------------------------------

    def _where(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def _uri(self, model: str, version: str) -> str:
        if callable(self._repository_uri):
            return self._repository_uri(model, version)
        return self._repository_uri.format(model=model, version=version)
