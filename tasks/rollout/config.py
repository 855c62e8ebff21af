"""The rollout's parts built from settings: the plan, the platform, the metrics source, the notifier."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx

from sluicegate.errors import ConfigError
from sluicegate.settings import Settings
from tasks.rollout.local import Fetch, LocalPlatform, client_tls
from tasks.rollout.metrics import MetricsSource, PrometheusSource, ScrapeSource
from tasks.rollout.plan import CustomCheck, RolloutPlan, Thresholds
from tasks.rollout.platform import RolloutPlatform

log = logging.getLogger(__name__)


def plan_from_settings(settings: Settings) -> RolloutPlan:
    r = settings.rollout
    try:
        checks = tuple(CustomCheck(**check) for check in r.custom_checks)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"SLUICEGATE_ROLLOUT__CUSTOM_CHECKS: {exc}; expected a JSON list of "
            '{"name", "query", "op", "bound", "relative"} objects'
        ) from exc
    try:
        return _plan(settings, checks)
    except ValueError as exc:  # RolloutPlan checks itself; here the values came from SLUICEGATE_ROLLOUT__*
        raise ConfigError(f"SLUICEGATE_ROLLOUT__*: {exc}; fix the rollout settings (sluicegate config)") from exc


def _plan(settings: Settings, checks: tuple[CustomCheck, ...]) -> RolloutPlan:
    r = settings.rollout
    return RolloutPlan(
        steps=r.steps,
        hold_s=r.hold_seconds,
        analysis_interval_s=r.analysis_interval_seconds,
        min_requests=r.min_requests,
        max_inconclusive=r.max_inconclusive,
        thresholds=Thresholds(
            r.max_p95_increase, r.min_p95_delta_seconds, r.max_error_rate_increase, r.latency_significance
        ),
        custom_checks=checks,
        pause_before=r.pause_before,
    )


def local_repository(settings: Settings) -> Path:
    return settings.rollout.local_repository or settings.home / "serving-repo"


def admin_token_file(settings: Settings) -> Path:
    """Where the embedded stack keeps the admin token it gave its local server when none is configured."""
    return settings.home / "serving-admin-token"


def platform_from_settings(settings: Settings, fetch: Fetch | None = None) -> RolloutPlatform:
    r = settings.rollout
    if r.platform == "kubernetes":
        from tasks.rollout.kubernetes import KubernetesPlatform, api_client_from_environment

        return KubernetesPlatform(
            api_client_from_environment(), namespace=r.namespace, istio=r.istio, ready_timeout_s=r.ready_timeout_seconds
        )
    token_file = admin_token_file(settings)
    if r.admin_token is not None:
        token = r.admin_token.get_secret_value()
    elif token_file.is_file():
        token = token_file.read_text().strip()
    else:
        raise ConfigError(
            "SLUICEGATE_ROLLOUT__ADMIN_TOKEN is unset: the local rollout moves traffic with the server's admin "
            "token; set it to the server's SLUICEGATE_SERVING__ADMIN_TOKEN "
            f"(the embedded stack keeps it in {token_file})"
        )
    return LocalPlatform(
        local_repository(settings),
        r.local_grpc,
        r.local_http,
        token,
        fetch=fetch,
        ready_timeout_s=r.ready_timeout_seconds,
        tls=client_tls(r),
    )


def source_from_settings(settings: Settings) -> MetricsSource:
    r = settings.rollout
    if r.prometheus_url:
        return PrometheusSource(r.prometheus_url)
    if r.custom_checks:
        raise ConfigError("SLUICEGATE_ROLLOUT__CUSTOM_CHECKS are PromQL: set SLUICEGATE_ROLLOUT__PROMETHEUS_URL too")
    tls = client_tls(r)
    return ScrapeSource(
        list(r.metrics_urls) or [f"{r.local_http.rstrip('/')}/metrics"],
        verify=tls.ssl_context() if tls is not None else True,
    )


def alertmanager_notifier(url: str | None) -> Callable[[str, str, str], None] | None:
    """A function posting a ``SluicegateRollback`` alert to Alertmanager's v2 API; None without a URL.

    A failed post is logged, never raised: the rollback itself already happened.
    """
    if not url:
        return None
    endpoint = f"{url.rstrip('/')}/api/v2/alerts"

    def notify(model: str, version: str, reason: str) -> None:
        alert = {
            "labels": {"alertname": "SluicegateRollback", "model": model, "version": version, "severity": "warning"},
            "annotations": {"summary": f"canary {model} {version} rolled back", "description": reason},
            "startsAt": datetime.now(UTC).isoformat(),
        }
        try:
            httpx.post(endpoint, json=[alert], timeout=10).raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("could not notify Alertmanager at %s about the rollback: %s", endpoint, exc)

    return notify
