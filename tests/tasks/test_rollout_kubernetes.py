"""The Kubernetes rollout platform against kmock, a Kubernetes API emulator over real HTTP.

kmock stores objects and answers create/get/patch/delete like an API server, but runs no controllers:
``Kubelet`` below plays the Deployment controller and the kubelet by writing each Deployment's status a
moment after its spec changes (or never making the pods Ready, for the timeout cases), and ``ApiServer``
adds the one API-server behaviour a rollout wait depends on, ``metadata.generation`` rising with the
spec in the same request. The stable Deployment and the Service are seeded the way ``kubectl apply`` of
the manifests would leave them, through the same client.
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kubernetes_validate
import pytest
from kubernetes.client import ApiClient, AppsV1Api, Configuration, CoreV1Api, CustomObjectsApi

from tasks.rollout import kubernetes_objects as objects
from tasks.rollout.kubernetes import KubernetesPlatform, api_client_from_environment
from tasks.rollout.platform import PlatformError, PlatformState

T = TypeVar("T")
NS = "sluicegate-serving"
MODEL = "classifier"
STABLE, CANARY = f"{MODEL}-stable", f"{MODEL}-canary"
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
ISTIO = {
    plural: kmock.resource("networking.istio.io", "v1", plural) for plural in ("virtualservices", "destinationrules")
}


class ApiServer(kmock.KubernetesEmulator):  # type: ignore[misc]
    """kmock plus ``metadata.generation``: raised when a create or patch changes a Deployment's spec,
    before the response goes out, as the real API server does (so a wait never takes the previous
    rollout's status for this one's)."""

    async def _handle(self, request: Any) -> Any:
        key = None
        if request.resource == DEPLOYMENTS and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            name = request.name or request.data.get("metadata", {}).get("name")
            key = (DEPLOYMENTS, request.namespace, name)
        before = self._spec(key)
        response = await super()._handle(request)
        after = self._spec(key)
        if key is not None and after is not None and after != before:
            stored = self.objects[key]
            generation = stored.raw.get("metadata", {}).get("generation") or 0
            stored.patch({"metadata": {"generation": generation + 1}})
        return response

    def _spec(self, key: Any) -> Any:
        if key is None or key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw.get("spec"))


class Kubelet:
    """The Deployment controller and kubelet in one: ``delay_s`` after a Deployment's spec changes,
    its status says every replica runs the new spec and is available, except where
    ``never_ready(deployment name, pod version)`` holds: those pods never become Ready (an image that
    cannot be pulled, a failing probe, no GPU to schedule on)."""

    def __init__(self, server: ApiServer, delay_s: float = 0.02) -> None:
        self.server = server
        self.delay_s = delay_s
        self.never_ready: Callable[[str, str | None], bool] = lambda name, version: False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        pending: dict[Any, float] = {}
        while True:
            for key in list(self.server.objects):
                if key[0] != DEPLOYMENTS or self.server.objects[key].deleted:
                    continue
                stored = self.server.objects[key]
                status = self._status(key[2], stored.raw)
                if stored.raw.get("status") == status:
                    pending.pop(key, None)
                elif loop.time() - pending.setdefault(key, loop.time()) >= self.delay_s:
                    stored.patch({"status": status})
                    pending.pop(key)
            await asyncio.sleep(0.005)

    def _status(self, name: str, raw: dict[str, Any]) -> dict[str, Any]:
        want = raw.get("spec", {}).get("replicas", 1)
        version = raw["spec"]["template"]["metadata"]["labels"].get(objects.VERSION_KEY)
        available = 0 if self.never_ready(name, version) else want
        return {
            "observedGeneration": raw.get("metadata", {}).get("generation") or 0,
            "replicas": want,
            "updatedReplicas": want,
            "readyReplicas": available,
            "availableReplicas": available,
        }


class Cluster:
    """kmock and the kubelet on an event loop of their own (the kubernetes client is synchronous), and
    reads of what kmock holds for the assertions."""

    def __init__(self) -> None:
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("kmock did not start")
        configuration = Configuration()
        configuration.host = self.url
        self.client = ApiClient(configuration)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ApiServer() as server, kmock.Server(server) as http:
            self.server = server
            self.kubelet = Kubelet(server)
            self.url = str(http.url).rstrip("/")
            kubelet = asyncio.create_task(self.kubelet.run())
            self._started.set()
            await self._stop.wait()
            kubelet.cancel()

    def close(self) -> None:
        assert self._loop is not None
        self.client.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def in_loop(self, call: Callable[[], T]) -> T:
        """Run ``call`` on kmock's loop, between requests (kmock's objects are not thread-safe)."""
        assert self._loop is not None
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(call())
            except Exception as exc:  # handed to the test thread
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(10)

    def get(self, resource: Any, name: str) -> dict[str, Any] | None:
        """What kmock holds now (a deep copy), None when absent or deleted."""

        def read() -> dict[str, Any] | None:
            key = (resource, NS, name)
            if key not in self.server.objects or self.server.objects[key].deleted:
                return None
            return copy.deepcopy(self.server.objects[key].raw)

        return self.in_loop(read)

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.get(DEPLOYMENTS, name)

    def platform(self, *, istio: bool, **options: Any) -> KubernetesPlatform:
        """A fresh platform object, as a re-run after a crash would construct."""
        settings: dict[str, Any] = {"ready_timeout_s": 10.0, "poll_interval_s": 0.01, **options}
        return KubernetesPlatform(self.client, namespace=NS, istio=istio, **settings)

    def seed(self, *, version: str = "1", replicas: int = 4, service_selector: dict[str, str] | None = None) -> None:
        """What ``kubectl apply`` of the model's manifests leaves: the stable Deployment and the Service."""
        labels = {objects.NAME_LABEL: MODEL, objects.TRACK_LABEL: "stable"}
        AppsV1Api(self.client).create_namespaced_deployment(
            NS,
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": STABLE, "labels": {**labels, objects.VERSION_KEY: version}},
                "spec": {
                    "replicas": replicas,
                    "selector": {"matchLabels": labels},
                    "progressDeadlineSeconds": 900,
                    "template": {
                        "metadata": {
                            "labels": {**labels, objects.VERSION_KEY: version},
                            "annotations": {objects.VERSION_KEY: version},
                        },
                        "spec": {
                            "containers": [
                                {
                                    "name": "server",
                                    "image": "ghcr.io/sluicegate/serving:1.0",
                                    "env": [
                                        {"name": "SLUICEGATE_SERVING__HOST", "value": "0.0.0.0"},
                                        {"name": objects.REPOSITORY_ENV, "value": f"models:/{MODEL}/{version}"},
                                    ],
                                    "readinessProbe": {"httpGet": {"path": "/health/ready", "port": 8000}},
                                    "livenessProbe": {
                                        "httpGet": {"path": "/health/live", "port": 8000},
                                        "initialDelaySeconds": 120,
                                    },
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                },
                                {"name": "log-shipper", "image": "fluent/fluent-bit:3.1"},
                            ]
                        },
                    },
                },
            },
        )
        CoreV1Api(self.client).create_namespaced_service(
            NS,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": MODEL},
                "spec": {
                    "selector": service_selector or {objects.NAME_LABEL: MODEL},
                    "ports": [{"name": "grpc", "port": 8001}, {"name": "http", "port": 8000}],
                },
            },
        )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    running = Cluster()
    try:
        yield running
    finally:
        running.close()


# --- what the objects say -------------------------------------------------------------------------------


def serving_env(deployment: dict[str, Any]) -> dict[str, str]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    serving = next(c for c in containers if c["name"] == "server")
    return {var["name"]: var["value"] for var in serving["env"]}


def assert_runs(deployment: dict[str, Any] | None, version: str, track: str) -> None:
    """Every place a version is written says ``version``; the other container is untouched."""
    assert deployment is not None
    template = deployment["spec"]["template"]
    assert serving_env(deployment) == {
        "SLUICEGATE_SERVING__HOST": "0.0.0.0",
        objects.REPOSITORY_ENV: f"models:/{MODEL}/{version}",
    }
    assert deployment["metadata"]["labels"][objects.VERSION_KEY] == version
    assert template["metadata"]["labels"][objects.VERSION_KEY] == version
    assert template["metadata"]["labels"][objects.TRACK_LABEL] == track
    assert template["metadata"]["annotations"][objects.VERSION_KEY] == version
    assert template["spec"]["containers"][1] == {"name": "log-shipper", "image": "fluent/fluent-bit:3.1"}


def annotations(deployment: dict[str, Any] | None) -> dict[str, str]:
    assert deployment is not None
    return dict(deployment["metadata"].get("annotations") or {})


def replicas(cluster: Cluster) -> tuple[int | None, int | None]:
    stable, canary = cluster.deployment(STABLE), cluster.deployment(CANARY)
    return (
        stable["spec"]["replicas"] if stable else None,
        canary["spec"]["replicas"] if canary else None,
    )


def routes(cluster: Cluster) -> list[tuple[str, int]]:
    service = cluster.get(ISTIO["virtualservices"], MODEL)
    assert service is not None
    route = next(e for e in service["spec"]["http"] if e["route"][0]["destination"]["host"] == MODEL)["route"]
    return [(r["destination"]["subset"], r["weight"]) for r in route]


def crash_promotion(cluster: Cluster, istio: bool) -> None:
    """A promotion that dies after patching stable: stable's pods of the new version never become
    Ready (on the canary's nodes they did), so promote times out, the PlatformError a flow would see,
    with stable already patched and the canary still there. They stay broken until the test says."""
    platform = cluster.platform(istio=istio, ready_timeout_s=0.3)
    platform.start_canary(MODEL, "2")
    platform.set_weight(MODEL, 50)
    cluster.kubelet.never_ready = lambda name, version: name == STABLE and version == "2"
    with pytest.raises(PlatformError, match=re.escape(f"{NS}/{STABLE}: not ready after 0.3s: 0 of 4 updated replicas")):
        platform.promote(MODEL)


# --- pure rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "percent", "split"),
    [
        (4, 0, (4, 0)),
        (4, 10, (3, 1)),  # any weight above 0 gets a pod
        (4, 25, (3, 1)),
        (4, 50, (2, 2)),
        (5, 50, (2, 3)),  # half rounds up, not to even
        (3, 90, (1, 3)),  # stable keeps a pod until 100%, the canary still gets its nearest count
        (2, 90, (1, 2)),
        (1, 50, (1, 1)),
        (4, 100, (0, 4)),
    ],
)
def test_replica_split(total: int, percent: int, split: tuple[int, int]) -> None:
    assert objects.replica_split(total, percent) == split


@pytest.mark.parametrize(("percent", "expected"), [(0, 1), (20, 1), (25, 1), (60, 3), (100, 4)])
def test_istio_canary_has_the_pods_for_its_share(percent: int, expected: int) -> None:
    assert objects.istio_canary_replicas(4, percent) == expected


def test_weighted_http_keeps_what_it_does_not_own() -> None:
    http = [
        {
            "name": "shadow",
            "match": [{"headers": {"x-shadow": {"exact": "1"}}}],
            "route": [{"destination": {"host": "other"}}],
        },
        {
            "name": "main",
            "timeout": "5s",
            "route": [{"destination": {"host": f"{MODEL}.{NS}.svc.cluster.local", "port": {"number": 8001}}}],
        },
    ]
    weighted = objects.weighted_http(http, MODEL, 30)
    assert weighted[0] == http[0]
    assert weighted[1]["timeout"] == "5s" and weighted[1]["name"] == "main"
    destination = {"host": f"{MODEL}.{NS}.svc.cluster.local", "port": {"number": 8001}}
    assert weighted[1]["route"] == [
        {"destination": {**destination, "subset": "stable"}, "weight": 70},
        {"destination": {**destination, "subset": "canary"}, "weight": 30},
    ]
    assert objects.virtual_service_weight({"spec": {"http": weighted}}, MODEL) == 30
    assert objects.virtual_service_weight({"spec": {"http": http}}, MODEL) == 0  # a lone stable destination


# --- a whole rollout, step by step ----------------------------------------------------------------------


def test_plain_rollout_splits_replicas_and_promotes(cluster: Cluster) -> None:
    cluster.seed()
    platform = cluster.platform(istio=False)
    assert platform.state(MODEL) == PlatformState(MODEL, "1", None, 0)

    assert platform.start_canary(MODEL, "2") == PlatformState(MODEL, "1", "2", 0)
    canary = cluster.deployment(CANARY)
    assert_runs(canary, "2", "canary")
    assert canary is not None and canary["spec"]["selector"] == {
        "matchLabels": {objects.NAME_LABEL: MODEL, objects.TRACK_LABEL: "canary"}
    }
    assert canary["spec"]["progressDeadlineSeconds"] == 900  # stable's spec, not just its pods
    assert annotations(canary) == {objects.TOTAL_REPLICAS: "4", objects.CANARY_WEIGHT: "0"}
    assert replicas(cluster) == (4, 0)  # a Ready canary pod would take traffic: none yet
    assert_runs(cluster.deployment(STABLE), "1", "stable")
    manifest = {k: v for k, v in canary.items() if k != "status"}
    kubernetes_validate.validate(manifest, "1.37.0", strict=True)

    for percent, split in [(25, (3, 1)), (50, (2, 2)), (100, (0, 4))]:
        assert platform.set_weight(MODEL, percent) == PlatformState(MODEL, "1", "2", percent)
        assert replicas(cluster) == split
        assert annotations(cluster.deployment(CANARY))[objects.CANARY_WEIGHT] == str(percent)

    assert platform.promote(MODEL) == PlatformState(MODEL, "2", None, 0, previous_stable_version="1")
    stable = cluster.deployment(STABLE)
    assert_runs(stable, "2", "stable")
    assert annotations(stable) == {objects.PREVIOUS_VERSION: "1"}  # no promotion left in progress
    assert replicas(cluster) == (4, None)


def test_istio_rollout_moves_weights_and_promotes(cluster: Cluster) -> None:
    cluster.seed()
    CustomObjectsApi(cluster.client).create_namespaced_custom_object(  # the manifests' own, with a timeout
        "networking.istio.io",
        "v1",
        NS,
        "virtualservices",
        {
            "apiVersion": "networking.istio.io/v1",
            "kind": "VirtualService",
            "metadata": {"name": MODEL},
            "spec": {"hosts": [MODEL], "http": [{"timeout": "5s", "route": [{"destination": {"host": MODEL}}]}]},
        },
    )
    platform = cluster.platform(istio=True)

    assert platform.start_canary(MODEL, "2") == PlatformState(MODEL, "1", "2", 0)
    assert_runs(cluster.deployment(CANARY), "2", "canary")
    assert replicas(cluster) == (4, 1)  # Ready, but out of traffic
    assert routes(cluster) == [("stable", 100), ("canary", 0)]
    rule = cluster.get(ISTIO["destinationrules"], MODEL)
    assert rule is not None and rule["spec"] == {
        "host": MODEL,
        "subsets": [
            {"name": "stable", "labels": {objects.TRACK_LABEL: "stable"}},
            {"name": "canary", "labels": {objects.TRACK_LABEL: "canary"}},
        ],
    }

    for percent, canary_replicas in [(20, 1), (60, 3)]:
        assert platform.set_weight(MODEL, percent) == PlatformState(MODEL, "1", "2", percent)
        assert routes(cluster) == [("stable", 100 - percent), ("canary", percent)]
        assert replicas(cluster) == (4, canary_replicas)  # stable keeps all its pods
    service = cluster.get(ISTIO["virtualservices"], MODEL)
    assert service is not None and service["spec"]["http"][0]["timeout"] == "5s"

    assert platform.promote(MODEL) == PlatformState(MODEL, "2", None, 0, previous_stable_version="1")
    assert_runs(cluster.deployment(STABLE), "2", "stable")
    assert routes(cluster) == [("stable", 100), ("canary", 0)]
    assert replicas(cluster) == (4, None)


# --- rollback -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("istio", [False, True], ids=["plain", "istio"])
def test_rollback_mid_rollout_returns_everything_to_stable(cluster: Cluster, istio: bool) -> None:
    cluster.seed()
    platform = cluster.platform(istio=istio)
    platform.start_canary(MODEL, "2")
    platform.set_weight(MODEL, 50)
    assert replicas(cluster) == ((2, 2) if not istio else (4, 2))

    assert platform.rollback(MODEL) == PlatformState(MODEL, "1", None, 0)
    assert cluster.deployment(CANARY) is None
    assert replicas(cluster) == (4, None)
    assert_runs(cluster.deployment(STABLE), "1", "stable")
    if istio:
        assert routes(cluster) == [("stable", 100), ("canary", 0)]


@pytest.mark.parametrize("istio", [False, True], ids=["plain", "istio"])
def test_rollback_after_a_crashed_promotion_restores_the_previous_version(cluster: Cluster, istio: bool) -> None:
    cluster.seed()
    crash_promotion(cluster, istio)
    platform = cluster.platform(istio=istio)  # the re-run; stable's new pods are still broken
    assert platform.state(MODEL) == PlatformState(MODEL, "2", "2", 50, previous_stable_version="1")
    assert annotations(cluster.deployment(STABLE))[objects.PROMOTION] == objects.PROMOTION_IN_PROGRESS

    assert platform.rollback(MODEL) == PlatformState(MODEL, "1", None, 0, previous_stable_version="1")
    stable = cluster.deployment(STABLE)
    assert_runs(stable, "1", "stable")
    assert objects.PROMOTION not in annotations(stable)
    assert replicas(cluster) == (4, None)
    if istio:
        assert routes(cluster) == [("stable", 100), ("canary", 0)]


@pytest.mark.parametrize("istio", [False, True], ids=["plain", "istio"])
def test_promote_again_finishes_a_crashed_promotion(cluster: Cluster, istio: bool) -> None:
    cluster.seed()
    crash_promotion(cluster, istio)
    cluster.kubelet.never_ready = lambda name, version: False  # the nodes got their GPUs
    platform = cluster.platform(istio=istio)
    with pytest.raises(PlatformError, match="in the middle of a promotion"):
        platform.start_canary(MODEL, "3")  # not over a half-promoted stable
    assert platform.promote(MODEL) == PlatformState(MODEL, "2", None, 0, previous_stable_version="1")
    stable = cluster.deployment(STABLE)
    assert_runs(stable, "2", "stable")
    assert annotations(stable) == {objects.PREVIOUS_VERSION: "1"}  # still what ran before, not 2
    assert replicas(cluster) == (4, None)


# --- idempotence and resuming ---------------------------------------------------------------------------


@pytest.mark.parametrize("istio", [False, True], ids=["plain", "istio"])
def test_every_step_twice_changes_nothing_the_second_time(cluster: Cluster, istio: bool) -> None:
    cluster.seed()

    def snapshot() -> list[Any]:
        held = [cluster.deployment(STABLE), cluster.deployment(CANARY)]
        if istio:
            held += [cluster.get(resource, MODEL) for resource in ISTIO.values()]
        for item in held:
            if item is not None:  # the kubelet's and the generation are not what a step decides
                item.pop("status", None)
                item["metadata"].pop("generation", None)
        return held

    steps: list[Callable[[KubernetesPlatform], PlatformState]] = [
        lambda p: p.start_canary(MODEL, "2"),
        lambda p: p.set_weight(MODEL, 30),
        lambda p: p.promote(MODEL),
        lambda p: p.start_canary(MODEL, "3"),
        lambda p: p.set_weight(MODEL, 60),
        lambda p: p.rollback(MODEL),
    ]
    for step in steps:
        first = step(cluster.platform(istio=istio))
        after_first = snapshot()
        assert step(cluster.platform(istio=istio)) == first
        assert snapshot() == after_first
    assert cluster.platform(istio=istio).state(MODEL) == PlatformState(MODEL, "2", None, 0, "1")


def test_a_canary_that_never_gets_ready_fails_start_and_a_rerun_resumes(cluster: Cluster) -> None:
    cluster.seed()
    cluster.kubelet.never_ready = lambda name, version: name == CANARY
    with pytest.raises(
        PlatformError, match=re.escape(f"Deployment {NS}/{CANARY}: not ready after 0.2s: 0 of 1 updated")
    ):
        cluster.platform(istio=True, ready_timeout_s=0.2).start_canary(MODEL, "2")
    assert routes(cluster) == [("stable", 100), ("canary", 0)]  # it never got traffic

    cluster.kubelet.never_ready = lambda name, version: False
    platform = cluster.platform(istio=True)  # the re-run reads where the crashed one stopped
    assert platform.state(MODEL) == PlatformState(MODEL, "1", "2", 0)
    assert platform.start_canary(MODEL, "2") == PlatformState(MODEL, "1", "2", 0)
    assert platform.set_weight(MODEL, 50) == PlatformState(MODEL, "1", "2", 50)
    assert platform.promote(MODEL).stable_version == "2"


def test_plain_canary_that_never_gets_ready_fails_its_first_weight_before_stable_shrinks(cluster: Cluster) -> None:
    cluster.seed()
    cluster.kubelet.never_ready = lambda name, version: name == CANARY
    platform = cluster.platform(istio=False, ready_timeout_s=0.2)
    platform.start_canary(MODEL, "2")  # 0 replicas: nothing to wait for yet
    with pytest.raises(
        PlatformError, match=re.escape(f"{NS}/{CANARY}: not ready after 0.2s: 0 of 1 updated replicas available")
    ):
        platform.set_weight(MODEL, 25)
    assert replicas(cluster) == (4, 1)  # stable untouched: the canary came up first and failed

    assert cluster.platform(istio=False).rollback(MODEL) == PlatformState(MODEL, "1", None, 0)
    assert replicas(cluster) == (4, None)


def test_a_new_version_replaces_a_canary_left_by_a_crashed_run(cluster: Cluster) -> None:
    cluster.seed()
    cluster.platform(istio=False).start_canary(MODEL, "2")
    cluster.platform(istio=False).set_weight(MODEL, 50)

    platform = cluster.platform(istio=False)
    assert platform.start_canary(MODEL, "3") == PlatformState(MODEL, "1", "3", 0)
    assert replicas(cluster) == (4, 0)  # stable back to the recorded total first
    assert_runs(cluster.deployment(CANARY), "3", "canary")
    assert annotations(cluster.deployment(CANARY)) == {objects.TOTAL_REPLICAS: "4", objects.CANARY_WEIGHT: "0"}


def test_a_canary_a_rollback_was_removing_is_no_canary(cluster: Cluster) -> None:
    cluster.seed()
    platform = cluster.platform(istio=False)
    platform.start_canary(MODEL, "2")
    platform.set_weight(MODEL, 50)
    apps = AppsV1Api(cluster.client)
    records = dict.fromkeys(annotations(cluster.deployment(CANARY)))
    for name, patch in [  # where a rollback leaves them if it dies just before deleting the canary
        (STABLE, {"spec": {"replicas": 4}}),
        (CANARY, {"spec": {"replicas": 0}, "metadata": {"annotations": records}}),
    ]:
        apps.patch_namespaced_deployment(name, NS, patch, _content_type="application/merge-patch+json")
    assert platform.state(MODEL) == PlatformState(MODEL, "1", None, 0)
    assert platform.rollback(MODEL) == PlatformState(MODEL, "1", None, 0)
    assert replicas(cluster) == (4, None)


def test_an_idle_canary_from_the_manifests_is_no_canary_until_a_rollout_takes_it_over(cluster: Cluster) -> None:
    """infra/k8s may ship ``<model>-canary`` at 0 replicas as a placeholder: not a canary, and
    start_canary patches it (the 409 path) instead of failing to create it."""
    cluster.seed()
    platform = cluster.platform(istio=False)
    platform.start_canary(MODEL, "3")
    placeholder = {"spec": {"replicas": 0}, "metadata": {"annotations": {objects.TOTAL_REPLICAS: None}}}
    AppsV1Api(cluster.client).patch_namespaced_deployment(
        CANARY, NS, placeholder, _content_type="application/merge-patch+json"
    )
    assert platform.state(MODEL) == PlatformState(MODEL, "1", None, 0)

    assert platform.start_canary(MODEL, "4") == PlatformState(MODEL, "1", "4", 0)
    assert_runs(cluster.deployment(CANARY), "4", "canary")
    assert annotations(cluster.deployment(CANARY)) == {objects.TOTAL_REPLICAS: "4", objects.CANARY_WEIGHT: "0"}


def test_the_serving_container_must_be_found(cluster: Cluster) -> None:
    cluster.seed()
    with pytest.raises(PlatformError, match=r"no container named 'model' \(containers: server, log-shipper\)"):
        cluster.platform(istio=False, container="model").start_canary(MODEL, "2")


def test_every_write_is_a_merge_patch(cluster: Cluster) -> None:
    """Istio's custom resources take no strategic merge patch, and kmock only merges: one patch type
    that means the same on both."""
    cluster.seed()
    platform = cluster.platform(istio=True)
    platform.start_canary(MODEL, "2")
    platform.set_weight(MODEL, 50)
    platform.promote(MODEL)
    patches = [r for r in cluster.in_loop(lambda: list(cluster.server)) if r.method == kmock.method.PATCH]
    assert {r.url.path.rsplit("/", 2)[-2] for r in patches} == {"deployments", "virtualservices"}
    assert {r.headers["Content-Type"] for r in patches} == {"application/merge-patch+json"}


# --- refusals and errors --------------------------------------------------------------------------------


def test_nothing_deployed(cluster: Cluster) -> None:
    platform = cluster.platform(istio=False)
    assert platform.state(MODEL) == PlatformState(MODEL, None, None, 0)
    with pytest.raises(PlatformError, match=f"no stable Deployment {NS}/{STABLE}: apply the model's manifests"):
        platform.start_canary(MODEL, "2")


def test_weights_need_a_canary(cluster: Cluster) -> None:
    cluster.seed()
    with pytest.raises(PlatformError, match="call start_canary first"):
        cluster.platform(istio=False).set_weight(MODEL, 10)
    with pytest.raises(ValueError, match=re.escape("0..100")):
        cluster.platform(istio=False).set_weight(MODEL, 101)


def test_a_service_that_selects_one_track_is_refused(cluster: Cluster) -> None:
    cluster.seed(service_selector={objects.NAME_LABEL: MODEL, objects.TRACK_LABEL: "stable"})
    with pytest.raises(PlatformError, match=re.escape(f"must select {objects.NAME_LABEL}: {MODEL} and not")):
        cluster.platform(istio=False).start_canary(MODEL, "2")
    assert cluster.deployment(CANARY) is None


def test_forbidden_names_the_object_and_the_role(cluster: Cluster) -> None:
    cluster.seed()
    forbidden = kmock.KubernetesError(
        status=403,
        reason="Forbidden",
        message=f'deployments.apps "{STABLE}" is forbidden: User "system:serviceaccount:{NS}:rollout" cannot get',
    )
    cluster.in_loop(lambda: cluster.server[kmock.action.FETCH, DEPLOYMENTS] << forbidden)
    with pytest.raises(PlatformError, match=f"get Deployment {NS}/{STABLE}: HTTP 403 Forbidden") as raised:
        cluster.platform(istio=False).state(MODEL)
    assert "is forbidden" in str(raised.value) and "rollout-rbac.yaml" in str(raised.value)


def test_an_unreachable_api_server_is_a_platform_error() -> None:
    configuration = Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard port: nothing listens
    configuration.retries = 0
    platform = KubernetesPlatform(ApiClient(configuration))
    with pytest.raises(PlatformError, match=re.escape("cannot reach the Kubernetes API at http://127.0.0.1:9")):
        platform.state(MODEL)


def test_repository_uri_can_name_the_registered_model(cluster: Cluster) -> None:
    cluster.seed()
    platform = cluster.platform(istio=False, repository_uri=lambda model, version: f"models:/sg-{model}/{version}")
    platform.start_canary(MODEL, "7")
    canary = cluster.deployment(CANARY)
    assert canary is not None and serving_env(canary)[objects.REPOSITORY_ENV] == f"models:/sg-{MODEL}/7"


def test_client_from_a_kubeconfig(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters: [{{name: kmock, cluster: {{server: '{cluster.url}'}}}}]\n"
        "users: [{name: tester, user: {token: t}}]\n"
        "contexts: [{name: kmock, context: {cluster: kmock, user: tester}}]\n"
    )
    cluster.seed()
    platform = KubernetesPlatform(api_client_from_environment(str(kubeconfig)), namespace=NS)
    assert platform.state(MODEL).stable_version == "1"


def test_no_credentials_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(PlatformError, match="no Kubernetes credentials"):
        api_client_from_environment(str(tmp_path / "absent"))
