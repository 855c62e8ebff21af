"""The Kubernetes rollout platform against kmock (tests/tasks/kmock_cluster.py), refusing and failing:
nothing deployed, no canary, a Service that selects one track, RBAC's 403, an unreachable API server;
and where its client comes from (a kubeconfig, none at all)."""

from __future__ import annotations

import re
from pathlib import Path

import kmock
import pytest
from kubernetes.client import ApiClient, Configuration

from tasks.rollout import kubernetes_objects as objects
from tasks.rollout.kubernetes import KubernetesPlatform, api_client_from_environment
from tasks.rollout.platform import PlatformError, PlatformState
from tests.tasks.kmock_cluster import CANARY, DEPLOYMENTS, MODEL, NS, STABLE, Cluster, serving_env

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
