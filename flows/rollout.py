"""The canary rollout flow: tasks/rollout/runner.py under Prefect, with what operators look at.

Each analysis read updates a rollout-step row in the metadata store (weights, observed metrics,
decision) and the Prefect table artifact ``rollout-<model>`` (the progression); a step in the plan's
``pause_before`` pauses the flow run until it is resumed (Prefect UI, or ``sluicegate rollout
resume``). Success moves the MLflow alias ``champion`` to the candidate; failure rolls back, puts the
``challenger`` alias back where it was, tags the registry version, notifies Alertmanager when one is
configured, records why, and fails the flow run. Also runs as a subflow of the pipeline after the eval
gate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from sluicegate.errors import SluicegateError
from sluicegate.settings import Settings


class RolloutFailed(SluicegateError):
    """The canary was rolled back (or aborted): the flow run fails with the reason."""


@flow(name="rollout", flow_run_name="rollout/{model_name}@{model_version}", log_prints=True)
def rollout(model_name: str, model_version: str, registry_version: str | None = None) -> dict[str, Any]:
    """Roll ``model_version`` (the pipeline's version string) of ``model_name`` out by the settings' plan."""
    from sluicegate.metadata import MetadataStore

    settings = Settings()
    store = MetadataStore(settings.metadata_url)
    try:
        with one_rollout_at_a_time(model_name):
            return run(settings, store, model_name, model_version, registry_version)
    finally:
        store.dispose()


@contextlib.contextmanager
def one_rollout_at_a_time(model_name: str) -> Iterator[None]:
    """Hold the model's rollout slot (a Prefect global concurrency limit of 1, created on first use).

    Two pipelines that pass their eval gates at once (two datasets landing together) would otherwise
    move the same model's traffic at the same time; the second waits for the first, visibly, in the UI.
    """
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = f"rollout-{_slug(model_name)}"
    # Another rollout may create it between upsert's read and its create.
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.upsert_global_concurrency_limit_by_name(name, 1)
    with concurrency(name, occupy=1, strict=True):
        yield


def run(
    settings: Settings, store: Any, model_name: str, model_version: str, registry_version: str | None = None
) -> dict[str, Any]:
    """The flow's body, callable from a parent flow that already holds settings and a store."""
    from sluicegate.metadata.models import ModelVersion
    from sluicegate.metadata.repository import create_deployment, finish_deployment, record_rollout_step
    from tasks import registry
    from tasks.rollout.config import (
        alertmanager_notifier,
        plan_from_settings,
        platform_from_settings,
        source_from_settings,
    )
    from tasks.rollout.plan import progression_table
    from tasks.rollout.runner import Hooks, run_rollout

    logger = get_run_logger()
    plan = plan_from_settings(settings)
    tracking_uri = settings.mlflow.url
    candidate = registry.resolve(tracking_uri, model_name, registry_version or model_version)

    def fetch(model: str, version: str, target: Any) -> None:
        # The registry lays a version out as <repository>/<model>/<version>, as the server reads it.
        placed = registry.download_version(tracking_uri, candidate, target.parent.parent)
        if placed != target:
            raise RolloutFailed(f"registry version {candidate.describe()} unpacked as {placed}, expected {target}")

    platform = platform_from_settings(settings, fetch=fetch)
    source = source_from_settings(settings)
    with store.session() as session:
        row = session.query(ModelVersion).filter_by(model_name=model_name, version=model_version).one_or_none()
        if row is None:
            raise RolloutFailed(f"model version {model_name} {model_version} is not in the metadata store")
        deployment_id = create_deployment(
            session, model_version_id=row.id, platform=platform.name, target=_target(settings, model_name)
        ).id
    rows: list[dict[str, Any]] = []
    key = f"rollout-{_slug(model_name)}"

    def on_step(step: dict[str, Any]) -> None:
        with store.session() as session:
            record_rollout_step(
                session,
                deployment_id=deployment_id,
                step_index=step["step_index"],
                canary_weight=step["canary_weight"],
                stable_weight=step["stable_weight"],
                observed={"stable": step["stable"], "canary": step["canary"], "checks": step["checks"]},
                decision=step["decision"],
                reason="; ".join(step["reasons"]) or None,
            )
        if rows and rows[-1]["step_index"] == step["step_index"]:
            rows[-1] = step
        else:
            rows.append(step)
        create_markdown_artifact(
            key=key,
            markdown=f"## Canary {model_name} {model_version}\n\n{progression_table(rows)}",
            description=f"rollout/{model_name}@{model_version}",
        )

    def before_step(index: int, weight: int) -> None:
        if weight in plan.pause_before:
            from prefect.flow_runs import pause_flow_run

            logger.info(
                "paused before step %d (%d%%): resume in the Prefect UI or `sluicegate rollout resume`", index, weight
            )
            pause_flow_run(timeout=24 * 3600)

    outcome = run_rollout(
        model_name, model_version, platform=platform, source=source, plan=plan, hooks=Hooks(on_step, before_step)
    )
    actor = f"rollout:{flow_run.get_name() or 'manual'}"
    if outcome.status == "promoted":
        registry.move_alias(tracking_uri, store, candidate, registry.CHAMPION, actor=actor, reason=outcome.reason)
        registry.set_tags(tracking_uri, candidate, {"sluicegate.rollout": "promoted"})
        with store.session() as session:
            finish_deployment(session, deployment_id, status="promoted", reason=outcome.reason)
        logger.info("%s %s promoted: %s", model_name, model_version, outcome.reason)
        return {"status": outcome.status, "reason": outcome.reason, "steps": len(outcome.steps)}
    _restore_challenger(tracking_uri, store, candidate, actor, outcome.reason)
    registry.set_tags(tracking_uri, candidate, {"sluicegate.rollout": outcome.status})
    with store.session() as session:
        finish_deployment(session, deployment_id, status="rolled_back", reason=outcome.reason)
    notify = alertmanager_notifier(settings.rollout.alertmanager_url)
    if notify is not None:
        notify(model_name, model_version, outcome.reason)
    raise RolloutFailed(f"{model_name} {model_version} {outcome.status.replace('_', ' ')}: {outcome.reason}")


def _restore_challenger(tracking_uri: str, store: Any, candidate: Any, actor: str, reason: str) -> None:
    """Put ``challenger`` back on what it pointed at before the candidate took it (or leave it)."""
    from sluicegate.errors import RegistryError
    from tasks import registry

    holder = registry.alias_holder(tracking_uri, candidate.name, registry.CHALLENGER)
    if holder is None or holder.registry_version != candidate.registry_version:
        return
    try:
        previous = registry.rollback_target(tracking_uri, store, candidate.name, registry.CHALLENGER)
    except RegistryError:
        return  # the candidate is the only challenger there ever was: nothing to restore it to
    registry.move_alias(
        tracking_uri, store, previous, registry.CHALLENGER, actor=actor, reason=f"canary rolled back: {reason}"
    )


def _target(settings: Settings, model_name: str) -> str:
    if settings.rollout.platform == "kubernetes":
        return f"{settings.rollout.namespace}/{model_name}"
    return f"local:{settings.rollout.local_http}"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())
