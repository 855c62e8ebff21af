"""The Kubernetes rollout platform against kmock (tests/tasks/kmock_cluster.py): the pure replica and
weight rules, and a whole rollout step by step, by replica ratio and by Istio weights. Rollback and
resuming are in test_rollout_kubernetes_recovery.py, refusals and errors in
test_rollout_kubernetes_errors.py."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kubernetes.client import CustomObjectsApi

from tasks.rollout import kubernetes_objects as objects
from tasks.rollout.platform import PlatformState
from tests.tasks.kmock_cluster import (
    CANARY,
    ISTIO,
    MODEL,
    NS,
    STABLE,
    Cluster,
    annotations,
    assert_runs,
    replicas,
    routes,
)

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
