"""`sluicegate demo`: the embedded stack, a dataset pushed to S3, the pipeline it triggers, its lineage."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.tree import Tree
from sqlalchemy import select

from sluicegate import stack
from sluicegate.errors import SluicegateError
from sluicegate.metadata import MetadataStore
from sluicegate.metadata import repository as repo
from sluicegate.metadata.models import Dataset, DatasetVersion, PipelineRun, S3Event
from sluicegate.runs import FlowRun, wait_for_flow_run
from sluicegate.settings import Settings
from tasks.transfer import push_directory


def run(
    settings: Settings, console: Console, *, keep_running: bool, timeout: float = 300, sample_count: int = 1500
) -> bool:
    """Returns True when the triggered pipeline run completed."""
    console.rule("[bold]1. the embedded stack")
    with console.status("starting S3+SQS, Prefect, MLflow, the event bridge and the runner..."):
        state, started = stack.up(settings)
    console.print(
        f"stack {'started' if started else 'already running'}: "
        + ", ".join(f"{name} {part.url}" for name, part in state.parts.items())
    )
    ok = False
    try:
        console.rule("[bold]2. a dataset version lands in S3")
        from tasks.sample_data import make_sample

        label = time.strftime("%Y-%m-%dT%H%M%S")
        directory = settings.home / "demo" / label
        with console.status(f"rendering {sample_count} PCB solder-joint images..."):
            make_sample(directory, count=sample_count, seed=int(time.time()) % 10_000)
        files = sum(1 for path in directory.rglob("*") if path.is_file())
        with Progress(TextColumn("uploading"), BarColumn(), MofNCompleteColumn(), console=console) as bar:
            task = bar.add_task("upload", total=files)
            pushed = push_directory(settings, directory, "pcb", label, on_file=lambda _: bar.advance(task))
        console.print(
            f"pushed s3://{pushed.bucket}/{pushed.manifest_key} "
            f"(data version {pushed.data_version[:7]}, {pushed.files} files, manifest last)"
        )

        console.rule("[bold]3. the S3 event triggers the pipeline")
        put_at = time.time()

        def show(run: FlowRun) -> None:
            console.print(f"  +{time.time() - put_at:5.1f} s  flow run [cyan]{run.name}[/cyan]: {run.state}")

        with console.status("waiting for the flow run..."):
            flow_run = wait_for_flow_run(settings.prefect.url, pushed.manifest_key, timeout=timeout, on_change=show)
        if flow_run is None:
            console.print(f"[red]no flow run finished within {timeout:.0f} s; see {settings.home / 'logs'}[/red]")
            return False
        ok = flow_run.state == "COMPLETED"
        if not ok:
            console.print(f"[red]the flow run ended {flow_run.state}: {flow_run.state_message}[/red]")

        console.rule("[bold]4. lineage")
        console.print(lineage_tree(settings, flow_run))
        ui = settings.prefect.url.removesuffix("/api")
        console.print(f"Prefect: {ui}/runs/flow-run/{flow_run.id}\nMLflow:  {settings.mlflow.url}")
    finally:
        if not keep_running:
            console.rule("[bold]5. stopping")
            stack.down(settings)
            console.print("the stack is stopped (run with --keep-running to leave it up)")
    return ok


def lineage_tree(settings: Settings, flow_run: FlowRun) -> Tree | Table:
    store = MetadataStore(settings.metadata_url)
    try:
        with store.session() as session:
            run = session.scalars(select(PipelineRun).where(PipelineRun.prefect_flow_run_id == flow_run.id)).first()
            if run is None:
                raise SluicegateError(f"no pipeline-run row for flow run {flow_run.id}")
            tree = Tree(f"pipeline run [bold]{run.id}[/bold]: {run.status} (trigger {run.trigger})")
            tree.add(f"Prefect flow run {flow_run.name} ({flow_run.id})")
            event = session.scalars(select(S3Event).where(S3Event.event_id == run.trigger_event_id)).first()
            if event is not None:
                tree.add(
                    f"event {event.event_id}: s3://{event.bucket}/{event.key} etag {event.etag} via {event.source}"
                )
            if run.dataset_version_id is not None:
                version = session.get(DatasetVersion, run.dataset_version_id)
                assert version is not None
                dataset = session.get(Dataset, version.dataset_id)
                node = tree.add(f"dataset {dataset.name if dataset else '?'} data version {version.data_version}")
                node.add(
                    f"{version.num_objects} objects pinned to S3 versions "
                    f"(manifest version {version.manifest_version_id})"
                )
            for gate in repo.gate_results_for_run(session, run.id):
                verdict = "passed" if gate.passed else "[red]FAILED[/red]"
                tree.add(f"{gate.gate} gate {verdict}: report {gate.report_uri}")
            tree.add(f"code {run.code_version}{' (dirty)' if run.code_dirty else ''}")
            tree.add(f"MLflow run {run.mlflow_run_id}")
            return tree
    finally:
        store.dispose()
