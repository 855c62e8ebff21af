"""The dataset pipeline: an S3 manifest event in, a gated candidate model out (README, "The path of one
dataset version"): pin the version, the data and feature gates, train + convert + package, the eval
gate against the champion, then the canary when the settings say so. Each stage is a short function
over the run's context (``flows.run_context``); ``pipeline`` is the script of stages.

This module is imported by every flow-run subprocess the runner spawns, before the run counts as
started: heavy libraries (sqlalchemy, boto3, mlflow, pandas) are imported inside the functions that
use them, not here, because their import time is event latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect import State, flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed

from flows import evaluate as eval_flow
from flows import gates
from flows import train as train_flow
from flows.run_context import RunContext
from flows.wrappers import stage
from sluicegate import ids, model_specs
from sluicegate.settings import Settings
from tasks import datasets, registry, tracking
from tasks.champion import PREPROCESSING_ARTIFACT

if TYPE_CHECKING:
    from sluicegate.metadata import MetadataStore
    from sluicegate.metadata.runs import RunStart


BODY_STARTED = "pipeline body started on"


@dataclass(frozen=True)
class PipelineResult:
    pipeline_run_id: int
    dataset: str
    data_version: str
    mlflow_run_id: str
    status: str
    model_version: str = ""
    registry_version: str = ""
    challenger: bool = False  # the eval gate passed and the candidate holds the challenger alias


def _resolve(
    settings: Settings, bucket: str, key: str, version_id: str | None
) -> tuple[datasets.ResolvedDataset, bytes]:
    from sluicegate import storage

    return datasets.resolve_dataset_version(
        storage.s3_client(settings),
        bucket,
        key,
        version_id,
        datasets_prefix=settings.storage.datasets_prefix,
        concurrency=settings.storage.max_concurrency,
    )


def _flow_run_state(flow_run_id: str | None) -> str:
    """The Prefect state type of a flow run ("MISSING" when there is none): is an earlier run still going?"""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if not flow_run_id:
        return "MISSING"
    with get_client(sync_client=True) as client:
        try:
            found = client.read_flow_run(UUID(flow_run_id))
        except ObjectNotFound:
            return "MISSING"
    return found.state.type.value if found.state else "UNKNOWN"


def _attach_dataset(store: MetadataStore, run_id: int, dataset: datasets.ResolvedDataset) -> int:
    from sluicegate.metadata import runs

    return runs.attach_dataset_version(
        store,
        run_id,
        dataset_name=dataset.name,
        data_version=dataset.data_version,
        bucket=dataset.bucket,
        prefix=dataset.prefix,
        manifest_key=dataset.manifest_key,
        manifest_etag=dataset.manifest_etag,
        manifest_version_id=dataset.manifest_version_id,
        objects=dataset.objects,
    )


def _begin(store: MetadataStore, **kwargs: Any) -> RunStart:
    from sluicegate.metadata import runs

    return runs.begin_run(store, run_state=_flow_run_state, **kwargs)


def _attach_mlflow(store: MetadataStore, run_id: int, mlflow_run_id: str) -> None:
    from sluicegate.metadata import runs

    runs.attach_mlflow_run(store, run_id, mlflow_run_id)


def _finish(store: MetadataStore, run_id: int, status: str, reason: str | None) -> None:
    from sluicegate.metadata import runs

    runs.finish_run(store, run_id, status, reason)


resolve_dataset = stage(_resolve, "resolve-dataset")
record_run_start = stage(_begin, "record-run-start")
record_dataset = stage(_attach_dataset, "record-dataset-version")
track_run = stage(tracking.start_pipeline_tracking, "mlflow-run")
record_mlflow = stage(_attach_mlflow, "record-mlflow-run")
end_tracking = stage(tracking.end_run, "mlflow-end-run")
record_finish = stage(_finish, "record-run-finish")
log_json = stage(tracking.log_json, "mlflow-log")
registry_version = stage(registry.get_version, "registry-version")


def _run_name() -> str:
    # Readable before the data version is known; renamed to pipeline/<name>@<data7> once pinned.
    key = str(flow_run.parameters.get("key", ""))
    try:
        ref = datasets.parse_dataset_key(key)
    except Exception:
        return "pipeline/" + (key.rsplit("/", 2)[0][-40:] or "unknown")
    return f"pipeline/{ref.name}@{ref.label}"


def _label_run(name: str, tags: list[str]) -> None:
    """Rename the flow run and add tags operators filter on in the UI (dataset, data and code version)."""
    from prefect.client.orchestration import get_client

    run_id = flow_run.get_id()
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(UUID(run_id), name=name, tags=sorted({*flow_run.tags, *tags}))


def pin_dataset(run: RunContext, bucket: str, key: str, version_id: str) -> None:
    """Stage 0: resolve and pin the dataset version, record it, start the MLflow run."""
    settings = run.settings
    dataset, run.manifest = resolve_dataset(settings, bucket, key, version_id or None)
    run.dataset = dataset
    run.note("resolve dataset", "passed", f"{len(dataset.objects)} objects pinned")
    # From here on every stage sees the dataset's model: its name, and its spec's settings.
    choice = model_specs.model_for_dataset(settings, dataset.name)
    settings = run.settings = model_specs.settings_for_model(settings, choice.name, choice.spec)
    run.note("model", choice.name, "from its model spec" if choice.spec is not None else "named after the dataset")
    _label_run(
        f"pipeline/{dataset.name}@{dataset.data7}",
        [
            f"dataset:{dataset.name}",
            f"model:{choice.name}",
            f"data:{dataset.data7}",
            f"code:{run.code.commit[:7]}",
        ],
    )
    run.dataset_version_id = record_dataset(run.store, run.run_id, dataset)
    run.mlflow_run_id = track_run(
        settings.mlflow.url,
        settings.mlflow.experiment,
        pipeline_run_id=str(run.run_id),
        flow_run_id=flow_run.get_id(),
        event_id=run.event_id or None,
        dataset=dataset,
        manifest=run.manifest,
        code=run.code,
    )
    record_mlflow(run.store, run.run_id, run.mlflow_run_id)
    tag_model(settings.mlflow.url, run.mlflow_run_id, choice.name, choice.spec)
    run.note("lineage", "recorded", f"MLflow run {run.mlflow_run_id}")


def _tag_model(tracking_uri: str, mlflow_run_id: str, model: str, spec: model_specs.ModelSpec | None) -> None:
    """The run's model and, when a spec chose it, the spec itself (what overrode the settings)."""
    tracker = tracking.client(tracking_uri)
    tracker.set_tag(mlflow_run_id, "sluicegate.model", model)
    if spec is not None:
        tracker.log_dict(mlflow_run_id, spec.model_dump(mode="json"), "model_spec.json")


tag_model = stage(_tag_model, "mlflow-model-tags")


def check_dataset(run: RunContext) -> dict[str, Any]:
    """Gates 1 and 2; returns the channel baseline the served model's drift monitor compares with.

    Between them the candidate's preprocessing is chosen (the data's shape is known once gate 1 read
    every image) and recorded: champions found later through the registry are compared with it.
    """
    outcome = gates.data_gate(run.settings, run.pinned, run.manifest)
    run.gate("data gate", outcome.verdict, evidence={"gx_validation": outcome.validation})
    log_json(run.settings.mlflow.url, run.tracked, outcome.baseline, "dataset/channel_baseline.json")
    run.spec, reference = gates.candidate_preprocessing(run.settings, outcome.shape)
    log_json(run.settings.mlflow.url, run.tracked, run.spec.to_dict(), PREPROCESSING_ARTIFACT)
    run.gate("feature gate", gates.feature_gate(run.settings, run.pinned, run.manifest, run.spec, reference))
    return outcome.baseline


def build_candidate(run: RunContext, baseline: dict[str, Any]) -> dict[str, str]:
    """Gates 3 and 4, then the model version; a re-run finds what an earlier attempt packaged."""
    earlier = train_flow.find_packaged(run.settings, run.code, run.pinned.data_version, run.tracked)
    if earlier is not None:
        run.note("train + convert", "found", f"{earlier.name}, packaged by an earlier attempt")
        packaged = train_flow.publish_model(run, earlier)
    else:
        trained = train_flow.train_model(run.settings, run.pinned, run.manifest, run.tracked, run.preprocessing)
        verdict = train_flow.check_training(run.settings, run.store, run.run_id, trained)
        learned = f"best val accuracy {trained.result.best_val_accuracy:.3f} at epoch {trained.result.best_epoch}"
        run.gate("train gate", verdict, detail=f"{verdict.reason()}; {learned}")
        converted = train_flow.convert_model(run.settings, trained)
        run.gate("convert", converted.verdict)
        packaged = train_flow.package_model(run, trained, converted, baseline)
    run.note("model version", "registered", f"{packaged['model_version']} (registry v{packaged['registry_version']})")
    return packaged


def evaluate_candidate(run: RunContext, packaged: dict[str, str]) -> None:
    """Gate 5: the candidate against the champion; on a pass it becomes the challenger."""
    settings = run.settings
    candidate = registry_version(settings.mlflow.url, settings.model.name, packaged["registry_version"])
    evaluated = eval_flow.evaluate_candidate(settings, run.pinned, run.manifest, Path(packaged["repository"]))
    report = eval_flow.publish_evaluation(run, evaluated, candidate)
    detail = eval_flow.stage_result(evaluated.verdict, evaluated.evaluations)
    run.gate("eval gate", evaluated.verdict, detail=detail, evidence=report.evidence, markdown=report.markdown)
    eval_flow.promote_challenger(run, candidate, evaluated.verdict)
    run.note("challenger", "alias set", f"{settings.model.name}@challenger = {candidate.model_version}")


def canary(run: RunContext, packaged: dict[str, str]) -> None:
    """Gates 6 and 7, when the settings run the canary right after the pipeline."""
    from flows.rollout import rollout as rollout_flow

    rolled = rollout_flow(run.settings.model.name, packaged["model_version"], packaged["registry_version"])
    run.note("canary", str(rolled["status"]), str(rolled["reason"]))


def succeed(run: RunContext, packaged: dict[str, str]) -> dict[str, Any]:
    dataset = run.pinned
    result = PipelineResult(
        run.run_id,
        dataset.name,
        dataset.data_version,
        run.tracked,
        "succeeded",
        packaged["model_version"],
        packaged["registry_version"],
        challenger=True,
    )
    end_tracking(run.settings.mlflow.url, run.tracked, succeeded=True, summary=asdict(result))
    record_finish(run.store, run.run_id, "succeeded", None)
    get_run_logger().info("pipeline run %s succeeded for %s@%s", run.run_id, dataset.name, dataset.data7)
    return asdict(result)


def fail(run: RunContext, exc: Exception) -> None:
    get_run_logger().error("pipeline run %s failed: %s", run.run_id, exc)
    record_finish(run.store, run.run_id, "failed", f"{type(exc).__name__}: {exc}")
    if run.mlflow_run_id is not None:
        end_tracking(run.settings.mlflow.url, run.mlflow_run_id, succeeded=False)


def skip(store: MetadataStore, start: RunStart) -> State[Any]:
    """A live flow run already works on this dataset version: record the skip and end without a failure."""
    reason = (
        f"flow run {start.busy_with} is already running the pipeline on this dataset version; if its "
        "process is gone, mark it Crashed or Cancelled in the Prefect UI and run this again"
    )
    get_run_logger().warning(reason)
    record_finish(store, start.run_id, "skipped", reason)
    skipped = {"pipeline_run_id": start.run_id, "status": "skipped", "reason": reason}
    return Completed(name="Skipped", message=reason, data=skipped)


def begin(
    settings: Settings, store: MetadataStore, trigger: str, parameters: dict[str, str]
) -> RunContext | State[Any]:
    """This flow run's row (its own again on a Prefect retry, an abandoned run's on the same dataset
    version, or a new one) and context; a Skipped state when a live run already works on that version."""
    code = ids.code_version(baked=settings.code_commit)
    event_id = parameters["event_id"]
    start = record_run_start(
        store,
        flow_run_id=flow_run.get_id(),
        trigger=trigger,
        event_id=event_id or None,
        code_commit=code.commit,
        code_dirty=code.dirty,
        parameters=parameters,
    )
    if start.busy_with is not None:
        return skip(store, start)
    if start.taken_over is not None:
        get_run_logger().info(
            "continuing pipeline run %s, abandoned by flow run %s: finished stages are found again, not redone",
            start.run_id,
            start.taken_over,
        )
    return RunContext(settings, store, start.run_id, code, event_id)


@flow(name="pipeline", flow_run_name=_run_name, log_prints=True)
def pipeline(
    bucket: str,
    key: str,
    version_id: str = "",
    etag: str = "",
    event_id: str = "",
    trigger: str = "event",
) -> dict[str, Any]:
    """Run every stage of the pipeline on the dataset version whose manifest is ``s3://bucket/key``.

    Args:
        bucket: bucket holding the dataset version.
        key: key of its ``manifest.csv``.
        version_id: S3 version id of the manifest (pins the exact bytes; empty: latest).
        etag: ETag of the manifest from the event (recorded; the version id is what pins).
        event_id: id of the Prefect event that triggered this run (empty for manual runs).
        trigger: "event", "schedule" or "manual".
    """
    # The body's first line: the log record's time is when the run's own code started (an operator's
    # "how long did this run wait", and the end of benchmarks/event_latency.py's PUT -> flow body).
    get_run_logger().info("%s s3://%s/%s", BODY_STARTED, bucket, key)
    from sluicegate.metadata import MetadataStore

    settings = Settings()
    parameters = {"bucket": bucket, "key": key, "version_id": version_id, "etag": etag, "event_id": event_id}
    with MetadataStore.checked(settings.metadata_url) as store:
        run = begin(settings, store, trigger, parameters)
        if not isinstance(run, RunContext):
            return run  # type: ignore[return-value]  # Skipped: Prefect's Completed state, not a failure
        try:
            pin_dataset(run, bucket, key, version_id)
            baseline = check_dataset(run)
            packaged = build_candidate(run, baseline)
            evaluate_candidate(run, packaged)
            if settings.rollout.after_pipeline:
                canary(run, packaged)
            return succeed(run, packaged)
        except Exception as exc:
            fail(run, exc)
            raise
        finally:
            run.publish_summary()
