"""MLflow run tracking: one run per pipeline run, tagged with data and code versions, the dataset as
input; gate reports and artifacts logged to it. (Walking lineage afterwards is ``tasks.lineage``.)

Uses an explicit ``MlflowClient`` (no fluent global state), so several tracking servers can be used
from one process (tests, the CLI) without cross-talk.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluicegate.ids import CodeVersion
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from mlflow import MlflowClient

TAG_PIPELINE_RUN = "sluicegate.pipeline_run_id"
TAG_FLOW_RUN = "sluicegate.prefect_flow_run_id"
TAG_EVENT = "sluicegate.trigger_event_id"
TAG_DATASET = "sluicegate.dataset"
TAG_DATA_VERSION = "sluicegate.data_version"
TAG_CODE_VERSION = "sluicegate.code_version"
TAG_CODE_DIRTY = "sluicegate.code_dirty"
TAG_OBJECTS_DIGEST = "sluicegate.objects_digest"


def client(tracking_uri: str) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def experiment_id(tracker: MlflowClient, name: str) -> str:
    experiment = tracker.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    from mlflow.exceptions import MlflowException

    try:
        return str(tracker.create_experiment(name))
    except MlflowException:  # created meanwhile by a concurrent pipeline run
        found = tracker.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def find_run(tracker: MlflowClient, experiment: str, pipeline_run_id: str) -> str | None:
    runs = tracker.search_runs(
        [experiment], filter_string=f"tags.`{TAG_PIPELINE_RUN}` = '{pipeline_run_id}'", max_results=1
    )
    return runs[0].info.run_id if runs else None


def start_pipeline_tracking(
    tracking_uri: str,
    experiment: str,
    *,
    pipeline_run_id: str,
    flow_run_id: str | None,
    event_id: str | None,
    dataset: ResolvedDataset,
    manifest: bytes,
    code: CodeVersion,
) -> str:
    """Create (or find, on a re-run) the MLflow run of a pipeline run; returns its run id.

    Logs the dataset as a run input (source: the manifest's S3 URI, digest: the data version), the
    manifest and the object-version map as artifacts, and the version tags.
    """
    tracker = client(tracking_uri)
    exp = experiment_id(tracker, experiment)
    existing = find_run(tracker, exp, pipeline_run_id)
    if existing is not None:
        return existing
    tags = {
        TAG_PIPELINE_RUN: pipeline_run_id,
        TAG_FLOW_RUN: flow_run_id or "",
        TAG_EVENT: event_id or "",
        TAG_DATASET: dataset.name,
        TAG_DATA_VERSION: dataset.data_version,
        TAG_OBJECTS_DIGEST: dataset.objects_digest,
        TAG_CODE_VERSION: code.commit,
        TAG_CODE_DIRTY: str(code.dirty).lower(),
    }
    run = tracker.create_run(exp, tags=tags, run_name=f"pipeline/{dataset.name}@{dataset.data7}")
    run_id: str = run.info.run_id
    _log_dataset_input(tracker, run_id, dataset, manifest)
    tracker.log_param(run_id, "dataset", dataset.name)
    tracker.log_param(run_id, "dataset_label", dataset.label)
    tracker.log_param(run_id, "rows", dataset.rows)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "dataset"
        folder.mkdir()
        (folder / "manifest.csv").write_bytes(manifest)
        (folder / "objects.json").write_text(
            json.dumps(
                {
                    "bucket": dataset.bucket,
                    "prefix": dataset.prefix,
                    "manifest_key": dataset.manifest_key,
                    "manifest_version_id": dataset.manifest_version_id,
                    "manifest_etag": dataset.manifest_etag,
                    "objects": dataset.objects,
                },
                indent=2,
                sort_keys=True,
            )
        )
        tracker.log_artifacts(run_id, str(folder), artifact_path="dataset")
    return run_id


def _log_dataset_input(tracker: MlflowClient, run_id: str, dataset: ResolvedDataset, manifest: bytes) -> None:
    import io

    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    frame = pd.read_csv(io.BytesIO(manifest), dtype=str, keep_default_na=False)
    logged = mlflow.data.from_pandas(frame, source=dataset.uri, name=dataset.name, digest=dataset.data7)
    tracker.log_inputs(
        run_id,
        datasets=[DatasetInput(logged._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "pipeline")])],
    )


def end_run(tracking_uri: str, run_id: str, *, succeeded: bool, summary: dict[str, Any] | None = None) -> None:
    tracker = client(tracking_uri)
    if summary:
        tracker.log_dict(run_id, summary, "pipeline/summary.json")
    tracker.set_terminated(run_id, status="FINISHED" if succeeded else "FAILED")


def log_gate(
    tracking_uri: str, run_id: str, verdict: GateVerdict, report_md: str, extra: dict[str, Any] | None = None
) -> str:
    """Log a gate's verdict, report and raw evidence (e.g. GX's validation result) to the MLflow run.

    Returns the artifact URI of the gate's folder, recorded on the gate-result row.
    """
    tracker = client(tracking_uri)
    folder = f"gates/{verdict.gate}"
    tracker.log_dict(run_id, verdict.to_dict(), f"{folder}/verdict.json")
    tracker.log_text(run_id, report_md, f"{folder}/report.md")
    for name, payload in (extra or {}).items():
        tracker.log_dict(run_id, payload, f"{folder}/{name}.json")
    tracker.log_metric(run_id, f"gate.{verdict.gate}.passed", 1.0 if verdict.passed else 0.0)
    tracker.set_tag(run_id, f"sluicegate.gate.{verdict.gate}", "passed" if verdict.passed else "failed")
    artifact_root: str = tracker.get_run(run_id).info.artifact_uri
    return f"{artifact_root.rstrip('/')}/{folder}"


def log_json(tracking_uri: str, run_id: str, payload: dict[str, Any], path: str) -> None:
    client(tracking_uri).log_dict(run_id, payload, path)
