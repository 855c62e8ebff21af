"""`sluicegate models`: the registry for operators. List versions, show one (metrics, lineage, aliases),
move the ``champion`` (or ``challenger``) alias by hand and roll it back, every move recorded with who
and why."""

from __future__ import annotations

import getpass
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from sluicegate import model_specs
from sluicegate.app.cli.common import ModelOption, cli_errors, console, load_settings, resolve_model
from sluicegate.errors import SluicegateError

if TYPE_CHECKING:
    from sluicegate.settings import Settings

models_app = typer.Typer(no_args_is_help=True, help="Model registry: versions, metrics, lineage, aliases.")

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ReasonOption = Annotated[str, typer.Option(help="Why (recorded with the alias move).")]


def _operator() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        return f"uid:{os.getuid()}"


ByOption = Annotated[str | None, typer.Option(help="Who (recorded); default: the login name.")]


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ") if ms else "-"


@models_app.command("ls")
def ls_command(model: ModelOption = None, as_json: JsonOption = False) -> None:
    """Every model with its champion and challenger; with --model, that model's versions, newest first."""
    from tasks import registry

    settings = load_settings()
    if model is not None:
        _versions(resolve_model(settings, model), as_json)
        return
    with cli_errors():
        found = registry.models(settings.mlflow.url)
        specs = model_specs.load_specs(model_specs.specs_folder(settings))
        champions = {m.name: registry.alias_holder(settings.mlflow.url, m.name, registry.CHAMPION) for m in found}
    rows: list[dict[str, Any]] = [
        {
            "model": m.name,
            "champion": getattr(champions[m.name], "model_version", None),
            "champion_registry_version": m.aliases.get(registry.CHAMPION),
            "challenger_registry_version": m.aliases.get(registry.CHALLENGER),
            "latest_registry_version": m.latest,
            "spec": m.name in specs,
            "datasets": list(specs[m.name].dataset_names()) if m.name in specs else None,
            "updated": _when(m.updated_ms or 0),
        }
        for m in found
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(f"no models registered at {settings.mlflow.url} yet: push a dataset version")
        return
    table = Table(title=f"models @ {settings.mlflow.url}")
    for column in ("model", "champion", "challenger", "latest", "spec", "updated"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["model"],
            f"{row['champion']} (v{row['champion_registry_version']})" if row["champion"] else "-",
            f"v{row['challenger_registry_version']}" if row["challenger_registry_version"] else "-",
            f"v{row['latest_registry_version']}" if row["latest_registry_version"] else "-",
            ", ".join(row["datasets"]) if row["datasets"] else "-",
            row["updated"],
        )
    console.print(table)


@models_app.command("check")
def check_command() -> None:
    """Validate every model spec (the model.specs folder); exit 1 naming the file, field and fix."""
    settings = load_settings()
    folder = model_specs.specs_folder(settings)
    from tasks.rollout.config import plan_from_settings

    with cli_errors():
        specs = model_specs.check_all(settings)
        for name in specs:
            try:
                # The canary plan's own rules (increasing steps ending at 100, ...) live with the plan.
                plan_from_settings(model_specs.settings_for_model(settings, name, specs[name]))
            except SluicegateError as exc:
                raise model_specs.SpecError(f"model spec of {name} in {folder}: canary: {exc}") from None
    if not specs:
        console.print(f"no model specs in {folder}: every dataset trains a model of its own name")
        return
    table = Table(title=f"model specs in {folder}")
    for column in ("model", "datasets", "overrides", "canary", "serving"):
        table.add_column(column, overflow="fold")
    for name, spec in specs.items():
        overrides = [f"{group}.{key}" for group in model_specs.GROUPS for key in getattr(spec, group)]
        serving = spec.serving
        table.add_row(
            name,
            ", ".join(spec.dataset_names()),
            ", ".join(overrides) or "-",
            ", ".join(f"{k}={v}" for k, v in spec.canary.items()) or "-",
            f"{serving.replicas} x {serving.cpu} cpu, {serving.memory}, {serving.gpu} gpu",
        )
    console.print(table)
    console.print(f"[green]{len(specs)} model spec(s) valid[/green]")


@models_app.command("manifests")
def manifests_command(
    out: Annotated[Path, typer.Option(help="Folder to write <model>/ overlays into (e.g. infra/k8s/models).")],
    model: Annotated[
        list[str] | None, typer.Option("--model", "-m", help="Only these models (default: every spec).")
    ] = None,
    image: Annotated[str | None, typer.Option(help="Serving image (name:tag or name@sha256:...).")] = None,
) -> None:
    """Write each model's Kubernetes overlay (infra/k8s/README.md) from its spec's serving resources."""
    from tasks.rollout.manifests import DEFAULT_IMAGE, model_overlay

    settings = load_settings()
    with cli_errors(ValueError):
        specs = model_specs.check_all(settings)
        names = model or sorted(specs)
        if not names:
            raise model_specs.SpecError(
                f"no model specs in {model_specs.specs_folder(settings)}: name the models with --model"
            )
        for name in names:
            serving = specs[name].serving if name in specs else model_specs.ServingResources()
            files = model_overlay(
                name, **serving.model_dump(), image=image or DEFAULT_IMAGE, istio=settings.rollout.istio
            )
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            for file_name, text in files.items():
                (folder / file_name).write_text(text, encoding="utf-8")
            console.print(f"{folder}: {', '.join(sorted(files))} (kubectl apply -k {folder})")


def _versions(settings: Settings, as_json: bool) -> None:
    from tasks import registry

    with cli_errors():
        versions = registry.list_versions(settings.mlflow.url, settings.model.name)
    if as_json:
        typer.echo(json.dumps([_version_dict(v) for v in versions], indent=2))
        return
    if not versions:
        console.print(f"no registered versions of {settings.model.name!r} at {settings.mlflow.url}")
        return
    table = Table(title=f"{settings.model.name} @ {settings.mlflow.url}")
    for column in ("registry", "model version", "aliases", "eval gate", "accuracy", "data", "created"):
        table.add_column(column)
    for v in versions:
        table.add_row(
            v.registry_version,
            v.model_version or "-",
            ", ".join(v.aliases) or "-",
            v.tags.get(registry.TAG_EVAL_GATE, "-"),
            v.tags.get("sluicegate.eval.accuracy", "-"),
            v.tags.get("sluicegate.data_version", "")[:7] or "-",
            _when(v.created_ms),
        )
    console.print(table)


def _version_dict(v: Any) -> dict[str, Any]:
    return {
        "registry_version": v.registry_version,
        "model_version": v.model_version,
        "aliases": list(v.aliases),
        "run_id": v.run_id,
        "source": v.source,
        "created": _when(v.created_ms),
        "tags": v.tags,
    }


@models_app.command("show")
def show_command(
    version: Annotated[str, typer.Argument(help="Registry version, model version (or prefix), or alias.")],
    model: ModelOption = None,
    as_json: JsonOption = False,
) -> None:
    """One version: evaluation metrics, lineage (data, code, runs, environment) and its alias history."""
    from tasks import registry, tracking

    settings = resolve_model(load_settings(), model)
    with cli_errors():
        found = registry.resolve(settings.mlflow.url, settings.model.name, version)
        run = tracking.client(settings.mlflow.url).get_run(found.run_id) if found.run_id else None
        record, moves = _recorded(settings, found)
    metrics = {k: v for k, v in (run.data.metrics.items() if run else []) if k.startswith(("eval.", "gate."))}
    detail = {
        **_version_dict(found),
        "metrics": dict(sorted(metrics.items())),
        "run_tags": {k: v for k, v in (run.data.tags.items() if run else []) if k.startswith("sluicegate.")},
        "metadata_store": record,
        "alias_history": moves,
    }
    if as_json:
        typer.echo(json.dumps(detail, indent=2, default=str))
        return
    _print_detail(found, detail)


def _recorded(settings: Settings, found: Any) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """What the metadata store holds on a registry version: its environment and artifacts, and its alias moves."""
    from sluicegate.metadata import MetadataStore
    from sluicegate.metadata.model_versions import alias_changes_for_version, find_model_version

    with MetadataStore.checked(settings.metadata_url) as store, store.session() as session:
        row = find_model_version(session, found.name, found.model_version)
        record = None if row is None else {"environment": row.environment, "artifacts": row.artifacts}
        moves = [
            {
                "when": m.created_at.isoformat(),
                "alias": m.alias,
                "to": m.registry_version,
                "from": m.previous_registry_version,
                "actor": m.actor,
                "reason": m.reason,
            }
            for m in alias_changes_for_version(session, found.name, found.registry_version)
        ]
    return record, moves


def _print_detail(found: Any, detail: dict[str, Any]) -> None:
    console.print(f"[bold]{found.describe()}[/bold]  aliases: {', '.join(found.aliases) or '-'}")
    lineage_table = Table(title="lineage", show_header=False)
    for key in ("sluicegate.data_version", "sluicegate.code_version", "sluicegate.mlflow_run_id"):
        lineage_table.add_row(key.split(".", 1)[1], found.tags.get(key, "-"))
    for key in ("sluicegate.dataset", "sluicegate.pipeline_run_id", "sluicegate.prefect_flow_run_id"):
        lineage_table.add_row(key.split(".", 1)[1], detail["run_tags"].get(key, "-"))
    lineage_table.add_row("source", found.source)
    console.print(lineage_table)
    metrics = Table(title="metrics (MLflow run)")
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    for key, value in detail["metrics"].items():
        metrics.add_row(key, f"{value:.4f}")
    console.print(metrics)
    record = detail["metadata_store"]
    if record:
        env = record["environment"]
        console.print(
            "environment: " + ", ".join(f"{k} {v}" for k, v in sorted(env.items()) if not isinstance(v, dict | list))
        )
    moves = Table(title="alias history")
    for column in ("when", "alias", "from", "to", "actor", "reason"):
        moves.add_column(column)
    for move in detail["alias_history"]:
        moves.add_row(
            move["when"], move["alias"], move["from"] or "-", move["to"] or "-", move["actor"], move["reason"]
        )
    console.print(moves)


@models_app.command("promote")
def promote_command(
    version: Annotated[str, typer.Argument(help="Registry version, model version (or prefix), or alias.")],
    reason: ReasonOption,
    alias: Annotated[str, typer.Option(help="The alias to move.")] = "champion",
    by: ByOption = None,
    force: Annotated[bool, typer.Option(help="Promote even a version that failed the eval gate.")] = False,
    model: ModelOption = None,
) -> None:
    """Point an alias (default: champion) at a version; the move is recorded with who and why."""
    from tasks import registry

    settings = resolve_model(load_settings(), model)
    with cli_errors():
        target = registry.resolve(settings.mlflow.url, settings.model.name, version)
        outcome = target.tags.get(registry.TAG_EVAL_GATE)
        if outcome == "failed" and not force:
            raise typer.BadParameter(
                f"{target.describe()} failed the eval gate; promote it anyway with --force", param_hint="VERSION"
            )
        _move(settings, target, alias, by, reason)


@models_app.command("rollback")
def rollback_command(
    reason: ReasonOption,
    alias: Annotated[str, typer.Option(help="The alias to move back.")] = "champion",
    by: ByOption = None,
    model: ModelOption = None,
) -> None:
    """Move an alias (default: champion) back to the version that held it before (from the recorded moves)."""
    from sluicegate.metadata import MetadataStore
    from tasks import registry

    settings = resolve_model(load_settings(), model)
    with cli_errors():
        with MetadataStore.checked(settings.metadata_url) as store:
            target = registry.rollback_target(settings.mlflow.url, store, settings.model.name, alias)
        _move(settings, target, alias, by, f"rollback: {reason}")


def _move(settings: Settings, target: Any, alias: str, by: str | None, reason: str) -> None:
    from sluicegate.metadata import MetadataStore
    from tasks import registry

    by = by or _operator()
    with MetadataStore.checked(settings.metadata_url) as store:
        change = registry.move_alias(settings.mlflow.url, store, target, alias, actor=by, reason=reason)
    if change is None:
        console.print(f"{alias} already points at {target.describe()}: nothing changed")
        return
    before = change.previous_model_version or change.previous_registry_version or "(none)"
    console.print(f"[green]{alias}[/green]: {before} -> {target.describe()}  (by {by}: {reason})")
