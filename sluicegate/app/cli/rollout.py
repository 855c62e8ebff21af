"""`sluicegate rollout`: the canary for operators. Start one, see where it stands, abort it (rollback) or
promote it now, and resume one paused before a step.

``abort`` and ``promote`` act on the platform itself; a running rollout flow notices at its next
metrics read (the platform is the source of truth) and ends as aborted or promoted-by-operator.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from sluicegate.app.cli.common import ModelOption, cli_errors, console, load_settings, resolve_model

if TYPE_CHECKING:
    from sluicegate.settings import Settings

rollout_app = typer.Typer(no_args_is_help=True, help="Canary rollout: run, status, abort, promote, resume.")


def _model(settings: Settings, model: str | None) -> str:
    return resolve_model(settings, model).model.name


@rollout_app.command("run")
def run_command(
    version: Annotated[str, typer.Argument(help="The model version (pipeline version string) to roll out.")],
    model: ModelOption = None,
    registry_version: Annotated[str | None, typer.Option(help="MLflow registry version, if not the string.")] = None,
) -> None:
    """Run the canary now (the `rollout` flow; the pipeline runs it after the eval gate)."""
    from flows.rollout import rollout

    settings = load_settings()
    with cli_errors():
        result = rollout(_model(settings, model), version, registry_version)
    console.print(result)


@rollout_app.command("status")
def status_command(model: ModelOption = None, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Where the model's traffic is now (stable, canary, weight) and the latest rollout's steps."""
    from tasks.rollout.config import platform_from_settings

    settings = load_settings()
    name = _model(settings, model)
    with cli_errors():
        state = platform_from_settings(settings).state(name)
        steps = _latest_steps(settings, name)
    if as_json:
        typer.echo(json.dumps({"state": state.__dict__, "steps": steps}, indent=2, default=str))
        return
    console.print(
        f"[bold]{name}[/]: stable {state.stable_version or '-'}, canary {state.canary_version or '-'} "
        f"at {state.canary_weight}% (previous stable {state.previous_stable_version or '-'})"
    )
    if steps:
        table = Table("step", "canary %", "decision", "reason", title=steps[0]["deployment"])
        for step in steps:
            table.add_row(str(step["step_index"]), str(step["canary_weight"]), step["decision"], step["reason"] or "")
        console.print(table)


@rollout_app.command("abort")
def abort_command(
    model: ModelOption = None, reason: Annotated[str, typer.Option(help="Why (logged).")] = "aborted by an operator"
) -> None:
    """Roll the canary back now: 100% on stable, the canary removed (a running flow then fails)."""
    from tasks.rollout.config import platform_from_settings

    settings = load_settings()
    with cli_errors():
        state = platform_from_settings(settings).rollback(_model(settings, model))
    console.print(f"rolled back ({reason}): stable {state.stable_version}, canary {state.canary_version or '-'}")


@rollout_app.command("promote")
def promote_command(model: ModelOption = None) -> None:
    """Promote the canary now, skipping the remaining steps (a running flow then ends as promoted and moves
    the champion alias)."""
    from tasks.rollout.config import platform_from_settings

    settings = load_settings()
    with cli_errors():
        state = platform_from_settings(settings).promote(_model(settings, model))
    console.print(f"promoted: stable {state.stable_version} (previous {state.previous_stable_version or '-'})")


@rollout_app.command("resume")
def resume_command(model: ModelOption = None) -> None:
    """Resume a rollout flow run paused before a step (the plan's pause_before)."""
    import anyio

    settings = load_settings()
    name = _model(settings, model)
    with cli_errors():
        resumed = anyio.run(_resume, name)
    if not resumed:
        raise typer.BadParameter(f"no paused rollout flow run for {name}", param_hint="--model")
    console.print(f"resumed {resumed}")


async def _resume(model: str) -> str | None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateName,
    )
    from prefect.flow_runs import aresume_flow_run

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["rollout"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(name=FlowRunFilterStateName(any_=["Paused"]))),
        )
    for run in runs:
        if run.name.startswith(f"rollout/{model}@"):
            await aresume_flow_run(run.id)
            return run.name
    return None


def _latest_steps(settings: Settings, model: str) -> list[dict[str, Any]]:
    from sluicegate.metadata import MetadataStore
    from sluicegate.metadata.rollouts import latest_deployment

    with MetadataStore.checked(settings.metadata_url) as store, store.session() as session:
        latest = latest_deployment(session, model)
        if latest is None:
            return []
        title = f"{model} {latest.model_version.version}: {latest.status}"
        return [
            {
                "deployment": title,
                "step_index": s.step_index,
                "canary_weight": s.canary_weight,
                "decision": s.decision,
                "reason": s.reason,
            }
            for s in latest.steps
        ]
