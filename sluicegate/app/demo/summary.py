"""The demo's closing summary: dataset versions, gate outcomes, model versions, canary steps, timings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from sluicegate.metadata import MetadataStore
from sluicegate.metadata.gates import gate_results_for_run
from sluicegate.metadata.model_versions import model_version_for_run
from sluicegate.metadata.runs import pipeline_run_for_flow_run

if TYPE_CHECKING:
    from sluicegate.app.demo.report import DemoReport, Outcome
    from sluicegate.settings import Settings

FIRST_CHAMPION_TARGET_S = 300.0
STAGES = ("resolve-dataset", "data-gate", "feature-gate", "train", "convert", "package-model", "eval-gate")


def recorded(store: MetadataStore, flow_run_id: str) -> tuple[list[tuple[str, bool]], str]:
    """(gate, passed) in the order they ran, and the model version, for a pipeline flow run."""
    with store.session() as session:
        run = pipeline_run_for_flow_run(session, flow_run_id)
        if run is None:
            return [], ""
        gates = gate_results_for_run(session, run.id)
        model = model_version_for_run(session, run.id)
        return [(gate.gate, gate.passed) for gate in gates], model.version if model else ""


def print_summary(console: Console, report: DemoReport, settings: Settings, store: MetadataStore) -> None:
    console.rule("[bold]summary")
    console.print(_versions_table(store, report))
    console.print(_stages_table(report))
    for outcome in report.outcomes:
        if any(weight < 100 for weight, _, _ in outcome.followed.steps):
            console.print(_canary_table(outcome))
    console.print(_models_table(settings))
    _print_timings(console, report)
    console.print(f"Prefect UI: {report.prefect_ui}/runs  (flow runs, task runs, artifacts)")
    console.print(f"MLflow UI:  {report.mlflow_ui}/#/models  (one registered model per dataset)")


def _models_table(settings: Settings) -> Table:
    """The models side by side: each with its own champion, served by the same local server."""
    from tasks import registry

    table = Table(title="models", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ("model", "champion", "input", "labels"):
        table.add_column(column, no_wrap=True)
    for model in registry.models(settings.mlflow.url):
        holder = registry.alias_holder(settings.mlflow.url, model.name, registry.CHAMPION)
        config = _served_config(settings, model.name, holder.model_version if holder else "")
        shape = config.inputs[0]["shape"] if config is not None else None
        table.add_row(
            model.name,
            holder.model_version if holder else "-",
            "x".join(str(d) for d in shape[1:]) if shape else "-",
            str(len(config.labels)) if config is not None else "-",
        )
    return table


def _served_config(settings: Settings, model: str, version: str) -> Any:
    from serving.errors import RepositoryError
    from serving.model_format import read_config
    from tasks.build import repository_root

    folder = repository_root(settings) / model / version
    try:
        return read_config(folder) if version and folder.is_dir() else None
    except RepositoryError:
        return None


def _versions_table(store: MetadataStore, report: DemoReport) -> Table:
    # Fits an 80-column terminal (piped output is 80 wide): no vertical rules, no flow-run column (its name
    # is pipeline/<dataset>@<data>), image counts in the stage log above, gates "5 ok" or the one that failed.
    table = Table(title="dataset versions", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in ("version", "data", "outcome", "gates", "model version", "champion"):
        table.add_column(column, no_wrap=True)
    for outcome in report.outcomes:
        run = outcome.flow_run
        gates, model = recorded(store, run.id) if run else ([], "")
        state = run.state if run else "no run"
        colour = "green" if state == "COMPLETED" else "red"
        table.add_row(
            outcome.step.label,
            outcome.data7,
            f"[{colour}]{state}[/{colour}]",
            _gates_cell(gates),
            model or "-",
            "yes" if outcome.champion_after else "no",
        )
    return table


def _gates_cell(gates: list[tuple[str, bool]]) -> str:
    failed = [name for name, passed in gates if not passed]
    if not gates:
        return "-"
    if not failed:
        return f"{len(gates)} ok"
    return f"[red]{' '.join(failed)} FAIL[/red]"


def _stages_table(report: DemoReport) -> Table:
    table = Table(title="wall time per stage (s), from Prefect's task runs")
    table.add_column("stage")
    for outcome in report.outcomes:
        table.add_column(outcome.step.label, justify="right")
    seconds = [outcome.stage_seconds() for outcome in report.outcomes]
    names = [name for name in STAGES if any(name in row for row in seconds)]
    names += sorted({name for row in seconds for name in row} - set(STAGES) - {"rollout"})
    for name in names:
        table.add_row(name, *(f"{row[name]:.1f}" if name in row else "-" for row in seconds))
    table.add_row(
        "[bold]manifest PUT -> run ended[/bold]", *(f"{o.finished_at - o.pushed_at:.1f}" for o in report.outcomes)
    )
    return table


def _canary_table(outcome: Outcome) -> Table:
    table = Table(title=f"canary of {outcome.step.label}")
    for column in ("canary weight", "decision", "reason"):
        table.add_column(column)
    for weight, decision, reason in outcome.followed.steps:
        table.add_row(f"{weight}%", decision, reason[:100])
    return table


def _print_timings(console: Console, report: DemoReport) -> None:
    first = report.seconds_to_champion(0)
    if first is not None:
        verdict = "within" if first <= FIRST_CHAMPION_TARGET_S else "[red]over[/red]"
        console.print(
            f"first champion serving {first:.0f} s after the first push ({verdict} the "
            f"{FIRST_CHAMPION_TARGET_S:.0f} s target)"
        )
    last = report.outcomes[-1] if report.outcomes else None
    if last is not None and last.champion_after and len(report.outcomes) > 1:
        console.print(f"event-to-promotion of {last.step.label}: {last.finished_at - last.pushed_at:.0f} s")
    if last is not None and last.traffic is not None:
        traffic = last.traffic
        console.print(
            f"client traffic during the canary: {traffic.sent} requests, {len(traffic.errors)} failed; "
            f"trace one: [bold]sluicegate lineage {traffic.last_request_id}[/bold]"
        )
