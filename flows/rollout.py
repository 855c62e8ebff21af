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
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from sluicegate import model_specs
from sluicegate.errors import SluicegateError
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from pathlib import Path

    from sluicegate.metadata import MetadataStore
    from tasks.registry import RegistryVersion
    from tasks.rollout.runner import Outcome


class RolloutFailed(SluicegateError):
    """The canary was rolled back (or aborted): the flow run fails with the reason."""


@dataclass(frozen=True)
class StepRecord:
    """One analysis read of a canary step, as tasks/rollout/runner.py reports it (a step read again
    replaces its earlier read): what the metadata store's rollout-step row and the progression show."""

    step_index: int
    canary_weight: int
    stable_weight: int
    decision: str
    reasons: tuple[str, ...]
    checks: Mapping[str, Any]
    stable: Mapping[str, Any]
    canary: Mapping[str, Any]
    canary_requests: float | None = None
    canary_p95_s: float | None = None
    stable_p95_s: float | None = None
    canary_error_rate: float | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> StepRecord:
        """The runner's row (``tasks.rollout.runner._row``) as a record."""
        return cls(
            step_index=row["step_index"],
            canary_weight=row["canary_weight"],
            stable_weight=row["stable_weight"],
            decision=row["decision"],
            reasons=tuple(row["reasons"]),
            checks=row["checks"],
            stable=row["stable"],
            canary=row["canary"],
            canary_requests=row.get("canary_requests"),
            canary_p95_s=row.get("canary_p95_s"),
            stable_p95_s=row.get("stable_p95_s"),
            canary_error_rate=row.get("canary_error_rate"),
        )

    @property
    def observed(self) -> dict[str, Any]:
        return {"stable": self.stable, "canary": self.canary, "checks": self.checks}

    @property
    def reason(self) -> str | None:
        return "; ".join(self.reasons) or None

    def table_row(self) -> dict[str, object]:
        """The columns of ``tasks.rollout.plan.progression_table``."""
        return {
            "step_index": self.step_index,
            "canary_weight": self.canary_weight,
            "decision": self.decision,
            "canary_requests": self.canary_requests,
            "canary_p95_s": self.canary_p95_s,
            "stable_p95_s": self.stable_p95_s,
            "canary_error_rate": self.canary_error_rate,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class Rollout:
    """One rollout's fixed facts: the flow's inputs, the registry version and its deployment row."""

    settings: Settings
    store: MetadataStore
    model_name: str
    model_version: str
    candidate: RegistryVersion
    deployment_id: int


@dataclass
class Progress:
    """What each analysis read updates: the step's row in the metadata store and the Prefect artifact
    ``rollout-<model>`` with the progression so far."""

    rollout: Rollout
    steps: list[StepRecord] = field(default_factory=list)

    def on_step(self, row: dict[str, Any]) -> None:
        from sluicegate.metadata import rollouts
        from tasks.rollout.plan import progression_table

        step = StepRecord.from_row(row)
        r = self.rollout
        rollouts.record_step(
            r.store,
            r.deployment_id,
            step_index=step.step_index,
            canary_weight=step.canary_weight,
            stable_weight=step.stable_weight,
            observed=step.observed,
            decision=step.decision,
            reason=step.reason,
        )
        if self.steps and self.steps[-1].step_index == step.step_index:
            self.steps[-1] = step
        else:
            self.steps.append(step)
        create_markdown_artifact(
            key=f"rollout-{_slug(r.model_name)}",
            markdown=f"## Canary {r.model_name} {r.model_version}\n\n"
            + progression_table([s.table_row() for s in self.steps]),
            description=f"rollout/{r.model_name}@{r.model_version}",
        )


@flow(name="rollout", flow_run_name="rollout/{model_name}@{model_version}", log_prints=True)
def rollout(model_name: str, model_version: str, registry_version: str | None = None) -> dict[str, Any]:
    """Roll ``model_version`` (the pipeline's version string) of ``model_name`` out by the settings' plan."""
    from sluicegate.metadata import MetadataStore

    # The model's own canary plan (its spec's) on top of the platform's settings.
    settings = model_specs.settings_for_model(Settings(), model_name)
    with MetadataStore.checked(settings.metadata_url) as store, one_rollout_at_a_time(model_name):
        return run(settings, store, model_name, model_version, registry_version)


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
    settings: Settings,
    store: MetadataStore,
    model_name: str,
    model_version: str,
    registry_version: str | None = None,
) -> dict[str, Any]:
    """The flow's body, callable from a parent flow that already holds settings and a checked store.

    Returns:
        ``{"status": "promoted", "reason": ..., "steps": <judged steps>}``.

    Raises:
        RolloutFailed: the canary was rolled back or aborted, or the model version is not recorded.
    """
    from tasks import registry
    from tasks.rollout.config import plan_from_settings, platform_from_settings, source_from_settings
    from tasks.rollout.runner import Hooks, run_rollout

    logger = get_run_logger()
    plan = plan_from_settings(settings)
    candidate = registry.resolve(settings.mlflow.url, model_name, registry_version or model_version)
    platform = platform_from_settings(settings, fetch=_fetcher(settings.mlflow.url, candidate))
    source = source_from_settings(settings)
    deployment_id = _begin_deployment(settings, store, model_name, model_version, platform.name)
    progress = Progress(Rollout(settings, store, model_name, model_version, candidate, deployment_id))
    outcome = run_rollout(
        model_name,
        model_version,
        platform=platform,
        source=source,
        plan=plan,
        hooks=Hooks(progress.on_step, _pauser(plan.pause_before, logger)),
    )
    actor = f"rollout:{flow_run.get_name() or 'manual'}"
    if outcome.status == "promoted":
        return _promoted(progress.rollout, outcome, actor, logger)
    _rolled_back(progress.rollout, outcome, actor)


def _fetcher(tracking_uri: str, candidate: RegistryVersion) -> Callable[[str, str, Path], None]:
    """How the platform gets the candidate's files: from the registry, into the server's repository."""
    from tasks import registry

    def fetch(model: str, version: str, target: Path) -> None:
        # The registry lays a version out as <repository>/<model>/<version>, as the server reads it.
        placed = registry.download_version(tracking_uri, candidate, target.parent.parent)
        if placed != target:
            raise RolloutFailed(f"registry version {candidate.describe()} unpacked as {placed}, expected {target}")

    return fetch


def _begin_deployment(
    settings: Settings, store: MetadataStore, model_name: str, model_version: str, platform: str
) -> int:
    from sluicegate.metadata import rollouts

    deployment_id = rollouts.begin_deployment(
        store,
        model_name=model_name,
        model_version=model_version,
        platform=platform,
        target=_target(settings, model_name),
    )
    if deployment_id is None:
        raise RolloutFailed(f"model version {model_name} {model_version} is not in the metadata store")
    return deployment_id


def _pauser(
    pause_before: tuple[int, ...], logger: logging.Logger | logging.LoggerAdapter[Any]
) -> Callable[[int, int], None]:
    """Before a step whose weight is in ``pause_before``: pause the flow run until it is resumed."""

    def before_step(index: int, weight: int) -> None:
        if weight in pause_before:
            from prefect.flow_runs import pause_flow_run

            logger.info(
                "paused before step %d (%d%%): resume in the Prefect UI or `sluicegate rollout resume`", index, weight
            )
            pause_flow_run(timeout=24 * 3600)

    return before_step


def _promoted(
    r: Rollout, outcome: Outcome, actor: str, logger: logging.Logger | logging.LoggerAdapter[Any]
) -> dict[str, Any]:
    """The candidate takes ``champion``; the deployment is recorded as promoted."""
    from sluicegate.metadata import rollouts
    from tasks import registry

    tracking_uri = r.settings.mlflow.url
    registry.move_alias(tracking_uri, r.store, r.candidate, registry.CHAMPION, actor=actor, reason=outcome.reason)
    registry.set_tags(tracking_uri, r.candidate, {"sluicegate.rollout": "promoted"})
    rollouts.end_deployment(r.store, r.deployment_id, "promoted", outcome.reason)
    logger.info("%s %s promoted: %s", r.model_name, r.model_version, outcome.reason)
    return {"status": outcome.status, "reason": outcome.reason, "steps": len(outcome.steps)}


def _rolled_back(r: Rollout, outcome: Outcome, actor: str) -> NoReturn:
    """``challenger`` back where it was, the version tagged, the deployment recorded, Alertmanager told."""
    from sluicegate.metadata import rollouts
    from tasks import registry
    from tasks.rollout.config import alertmanager_notifier

    tracking_uri = r.settings.mlflow.url
    _restore_challenger(tracking_uri, r.store, r.candidate, actor, outcome.reason)
    registry.set_tags(tracking_uri, r.candidate, {"sluicegate.rollout": outcome.status})
    rollouts.end_deployment(r.store, r.deployment_id, "rolled_back", outcome.reason)
    notify = alertmanager_notifier(r.settings.rollout.alertmanager_url)
    if notify is not None:
        notify(r.model_name, r.model_version, outcome.reason)
    raise RolloutFailed(f"{r.model_name} {r.model_version} {outcome.status.replace('_', ' ')}: {outcome.reason}")


def _restore_challenger(
    tracking_uri: str, store: MetadataStore, candidate: RegistryVersion, actor: str, reason: str
) -> None:
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
