"""A Kubernetes cluster for the rollout platform's tests: kmock, a Kubernetes API emulator over real HTTP.

kmock stores objects and answers create/get/patch/delete like an API server, but runs no controllers:
``Kubelet`` below plays the Deployment controller and the kubelet by writing each Deployment's status a
moment after its spec changes (or never making the pods Ready, for the timeout cases), and ``ApiServer``
adds the one API-server behaviour a rollout wait depends on, ``metadata.generation`` rising with the
spec in the same request. The stable Deployment and the Service are seeded the way ``kubectl apply`` of
the manifests would leave them, through the same client. The readers at the end say what the objects
hold now (versions, annotations, replicas, Istio routes).
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import kmock
from kubernetes.client import ApiClient, AppsV1Api, Configuration, CoreV1Api

from tasks.rollout import kubernetes_objects as objects
from tasks.rollout.kubernetes import KubernetesPlatform

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
