"""How `sluicegate lineage` shows a walk: a rich ``Tree`` for people, one JSON document for scripts.

The JSON document is the records of ``tasks/lineage/records.py`` as they are (field names are the keys,
times ISO 8601 in UTC), under ``"format": "sluicegate.lineage/1"``; a breaking change bumps the number.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.tree import Tree

if TYPE_CHECKING:
    from tasks.lineage.records import (
        DataLineage,
        DatasetInfo,
        DeploymentInfo,
        Lineage,
        ModelLineage,
        ModelRecord,
        PipelineRunInfo,
        TrainingRun,
    )
    from tasks.lineage.request_logs import RequestLine

FORMAT = "sluicegate.lineage/1"
# What the tree shows of the environment JSON (all of it is in --json), in this order.
_ENVIRONMENT = ("python", "torch", "torch_cuda", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "driver")
_PARAMS_SHOWN = 8


def document(lineage: Lineage) -> dict[str, Any]:
    """The walk as one JSON-ready mapping (stable keys)."""
    return {"format": FORMAT, **_plain(dataclasses.asdict(lineage))}


def dumps(lineage: Lineage) -> str:
    return json.dumps(document(lineage), indent=2, default=str)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def tree(lineage: Lineage) -> Tree:
    """The walk as a tree, rooted at what was asked for."""
    root = Tree(f"[bold]lineage of {escape(lineage.query)}[/bold] ({lineage.kind})")
    if lineage.request is not None:
        _request(root, lineage.request)
    if lineage.model is not None:
        _model(root, lineage.model)
    if lineage.data is not None:
        _data(root, lineage.data)
    if not lineage.mlflow.reachable:
        root.add(
            f"[yellow]MLflow at {escape(lineage.mlflow.url)} was not reachable[/yellow] "
            f"({escape(lineage.mlflow.error or 'no answer')}): training runs, registry aliases and "
            "metrics are left out; the rest is from the metadata store"
        )
    for note in lineage.notes:
        root.add(f"[yellow]note:[/yellow] {escape(note)}")
    return root


def _when(value: datetime | str | None) -> str:
    if value is None:
        return "-"
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if isinstance(value, datetime) else value


def _request(root: Tree, line: RequestLine) -> None:
    node = root.add(
        f"request [bold]{escape(line.request_id)}[/bold] at {escape(line.timestamp)}: {escape(line.status)}"
    )
    node.add(f"model {escape(line.model_name)} {escape(line.model_version)} (runtime {escape(str(line.runtime))})")
    # The digest names its algorithm ("xxh3-128:...", or "sha256:..." from older logs).
    node.add(f"input {escape(str(line.input_digest))}, batch {line.batch_size}, {line.inference_time_ms} ms")
    node.add(f"[dim]logged at {escape(line.source)}[/dim]")


def _model(root: Tree, lineage: ModelLineage) -> None:
    node = _record(root, lineage.model)
    dirty = {True: " [red](dirty)[/red]", False: "", None: " (dirty: unknown)"}[lineage.code_dirty]
    node.add(f"code {escape(lineage.model.code_version)}{dirty}")
    node.add("environment " + escape(_environment(lineage.environment)))
    if lineage.pipeline_run is not None:
        _run(node, lineage.pipeline_run)
    if lineage.training_run is not None:
        _training(node, lineage.training_run)
    if lineage.dataset is not None:
        _dataset(node, lineage.dataset)
    _upward(node, lineage.model)


def _record(root: Tree, model: ModelRecord) -> Tree:
    registry = f" (registry v{model.registry_version})" if model.registry_version else ""
    aliases = f"  [green]{', '.join(model.aliases)}[/green]" if model.aliases else ""
    return root.add(f"model version [bold]{escape(model.model_name)} {escape(model.version)}[/bold]{registry}{aliases}")


def _upward(node: Tree, model: ModelRecord) -> None:
    if model.deployments:
        deployments = node.add("deployments")
        for deployment in model.deployments:
            _deployment(deployments, deployment)
    if model.alias_moves:
        moves = node.add("alias moves")
        for move in model.alias_moves:
            what = (
                f"{move.alias} -> this" if move.direction == "to" else f"{move.alias} moved off to {move.model_version}"
            )
            moves.add(f"{_when(move.at)} {escape(what)} (by {escape(move.actor)}: {escape(move.reason)})")


def _deployment(parent: Tree, deployment: DeploymentInfo) -> None:
    colour = {"promoted": "green", "rolled_back": "red", "failed": "red"}.get(deployment.status, "yellow")
    reason = f": {escape(deployment.reason)}" if deployment.reason else ""
    node = parent.add(
        f"#{deployment.id} {escape(deployment.platform)} {escape(deployment.target)} "
        f"[{colour}]{deployment.status}[/{colour}]{reason} ({_when(deployment.started_at)})"
    )
    for step in deployment.steps:
        why = f": {escape(step.reason)}" if step.reason else ""
        node.add(
            f"step {step.step_index}: canary {step.canary_weight}% / stable {step.stable_weight}% {step.decision}{why}"
        )


def _environment(env: dict[str, Any]) -> str:
    parts = [f"{key} {env[key]}" for key in _ENVIRONMENT if env.get(key)]
    gpus = env.get("gpus")
    if isinstance(gpus, list) and gpus:
        parts.append("GPU " + ", ".join(str(g.get("name")) for g in gpus if isinstance(g, dict)))
    return ", ".join(parts) or "(not recorded)"


def _run(parent: Tree, run: PipelineRunInfo) -> None:
    colour = "green" if run.status == "succeeded" else "red" if run.status == "failed" else "yellow"
    reason = f": {escape(run.reason)}" if run.reason else ""
    node = parent.add(f"pipeline run {run.id} [{colour}]{run.status}[/{colour}]{reason} ({_when(run.started_at)})")
    node.add(f"Prefect flow run {run.prefect_flow_run_id or '-'}, trigger {run.trigger}")
    event = run.trigger_event
    if event is not None:
        node.add(
            f"S3 event {event.event_id} ({event.source}): s3://{escape(event.bucket)}/{escape(event.key)} "
            f"version {event.version_id or '-'} etag {escape(event.etag)} at {_when(event.event_time)}"
        )
    elif run.trigger_event_id:
        node.add(f"event {run.trigger_event_id} (not recorded by the bridge)")
    if run.gates:
        gates = node.add("gates")
        for gate in run.gates:
            failed = [c.name for c in gate.checks if not c.passed]
            verdict = "[green]passed[/green]" if gate.passed else f"[red]FAILED[/red] ({escape(', '.join(failed))})"
            gates.add(f"{escape(gate.gate)} {verdict}")


def _training(parent: Tree, run: TrainingRun) -> None:
    best = f", best val accuracy {run.best_val_accuracy:.4f}" if run.best_val_accuracy is not None else ""
    node = parent.add(f"MLflow run {run.run_id} {run.status}{best}")
    node.add(f"[link={run.url}]{escape(run.url)}[/link]")
    shown = list(run.params.items())[:_PARAMS_SHOWN]
    if shown:
        more = f" (+{len(run.params) - len(shown)} more)" if len(run.params) > len(shown) else ""
        node.add("params " + escape(", ".join(f"{k}={v}" for k, v in shown)) + more)


def _dataset(parent: Tree, dataset: DatasetInfo) -> None:
    node = parent.add(f"dataset [bold]{escape(dataset.name)}[/bold] data version {dataset.data_version}")
    version = dataset.manifest_version_id or "unversioned"
    node.add(
        f"manifest s3://{escape(dataset.bucket)}/{escape(dataset.manifest_key)} "
        f"(version {escape(version)}, etag {escape(dataset.manifest_etag)})"
    )
    if dataset.objects is None:
        node.add(f"{dataset.num_objects} objects under {escape(dataset.prefix)} (--objects lists them)")
        return
    objects = node.add(f"{dataset.num_objects} objects under {escape(dataset.prefix)}")
    for obj in dataset.objects:
        objects.add(f"{escape(obj.path)}  version {obj.version_id or '-'}  etag {obj.etag or '-'}  {obj.size} B")


def _data(root: Tree, data: DataLineage) -> None:
    _dataset(root, data.dataset)
    runs = root.add(f"pipeline runs ({len(data.pipeline_runs)})")
    for run in data.pipeline_runs:
        _run(runs, run)
    models = root.add(f"model versions ({len(data.models)})")
    for model in data.models:
        _upward(_record(models, model), model)
    champion = f"[green]{escape(data.champion)}[/green]" if data.champion else "none of these"
    root.add(f"champion now: {champion}")
