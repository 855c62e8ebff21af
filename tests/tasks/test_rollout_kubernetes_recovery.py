"""The Kubernetes rollout platform against kmock (tests/tasks/kmock_cluster.py), recovering: rollback
mid-rollout and after a crashed promotion, promoting again, every step twice without a change, and a
re-run that resumes where a crashed or timed-out one stopped."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import kmock
import pytest
from kubernetes.client import AppsV1Api

from tasks.rollout import kubernetes_objects as objects
from tasks.rollout.kubernetes import KubernetesPlatform
from tasks.rollout.platform import PlatformError, PlatformState
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
