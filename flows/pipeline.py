"""The dataset pipeline: an S3 manifest event in, a gated candidate model out.

Stages present so far: resolve and pin the dataset version, record the pipeline run (metadata store
and MLflow), publish a summary artifact. Each later gate is added to this same flow.

This module is imported by every flow-run subprocess the runner spawns, before the run counts as
started: heavy libraries (sqlalchemy, boto3, mlflow, pandas) are imported inside the functions that
use them, not here, because their import time is event latency.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed

from flows import evaluate as eval_flow
from flows import gates
from flows import train as train_flow
from flows.wrappers import stage
from sluicegate import ids
from sluicegate.settings import Settings
from tasks import datasets, registry, reports, tracking
from tasks.champion import PREPROCESSING_ARTIFACT

if TYPE_CHECKING:
    from sluicegate.metadata import MetadataStore


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


# Prefect state types of a flow run that is still going (or about to); any other means it ended.
_ACTIVE = ("RUNNING", "PENDING", "SCHEDULED", "PAUSED", "CANCELLING")


@dataclass(frozen=True)
class RunStart:
    run_id: int
    taken_over: str | None = None  # the abandoned flow run this one continues
    busy_with: str | None = None  # a live flow run already on this dataset version


def _flow_run_state(flow_run_id: str | None) -> str:
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


def _start_run(
    store: MetadataStore, *, trigger: str, event_id: str | None, code: ids.CodeVersion, parameters: dict[str, Any]
) -> RunStart:
    """This flow run's row: its own again when Prefect retries it; an abandoned run's on the same dataset
    version when that one's process died (idempotency: its MLflow run, model and registry versions are
    found again, not duplicated); or a new one, noting a live run on the same version if there is one."""
    from sluicegate.metadata import repository as repo
    from sluicegate.metadata import takeover
    from sluicegate.metadata.models import PipelineRun

    own = flow_run.get_id()
    busy: str | None = None
    with store.session() as session:
        seen = own is not None and session.query(PipelineRun).filter_by(prefect_flow_run_id=own).count() > 0
        for earlier in (
            []
            if seen
            else takeover.unfinished_runs_like(
                session, code_version=code.commit, parameters=parameters, exclude_flow_run_id=own
            )
        ):
            state = _flow_run_state(earlier.prefect_flow_run_id)
            if state in _ACTIVE:
                busy = earlier.prefect_flow_run_id
                continue
            previous = earlier.prefect_flow_run_id
            takeover.take_over(session, earlier, prefect_flow_run_id=own, previous_state=state)
            return RunStart(earlier.id, taken_over=previous or "unknown")
        row = repo.start_pipeline_run(
            session,
            prefect_flow_run_id=own,
            trigger=trigger,
            trigger_event_id=event_id,
            code_version=code.commit,
            code_dirty=code.dirty,
            parameters=parameters,
        )
        return RunStart(row.id, busy_with=busy)


def _record_dataset(store: MetadataStore, run_id: int, dataset: datasets.ResolvedDataset) -> int:
    from sluicegate.metadata import repository as repo

    with store.session() as session:
        version = repo.upsert_dataset_version(
            session,
            dataset_name=dataset.name,
            data_version=dataset.data_version,
            bucket=dataset.bucket,
            prefix=dataset.prefix,
            manifest_key=dataset.manifest_key,
            manifest_etag=dataset.manifest_etag,
            manifest_version_id=dataset.manifest_version_id,
            objects=dataset.objects,
        )
        repo.set_pipeline_run_dataset(session, run_id, version.id)
        return version.id


def _record_mlflow(store: MetadataStore, run_id: int, mlflow_run_id: str) -> None:
    from sluicegate.metadata import repository as repo

    with store.session() as session:
        repo.set_pipeline_run_mlflow(session, run_id, mlflow_run_id)


def _finish(store: MetadataStore, run_id: int, status: str, reason: str | None) -> None:
    from sluicegate.metadata import repository as repo

    with store.session() as session:
        repo.finish_pipeline_run(session, run_id, status=status, reason=reason)


resolve_dataset = stage(_resolve, "resolve-dataset")
record_run_start = stage(_start_run, "record-run-start")
record_dataset = stage(_record_dataset, "record-dataset-version")
track_run = stage(tracking.start_pipeline_tracking, "mlflow-run")
record_mlflow = stage(_record_mlflow, "record-mlflow-run")
end_tracking = stage(tracking.end_run, "mlflow-end-run")
record_finish = stage(_finish, "record-run-finish")
log_json = stage(tracking.log_json, "mlflow-log")
registry_version = stage(registry.get_version, "registry-version")


def _artifact_key(dataset: str) -> str:
    return "pipeline-" + re.sub(r"[^a-z0-9-]+", "-", dataset.lower()).strip("-")


def _run_name() -> str:
    # Readable before the data version is known; renamed to pipeline/<name>@<data7> once pinned.
    key = str(flow_run.parameters.get("key", ""))
    try:
        ref = datasets.parse_dataset_key(key)
    except Exception:
        return "pipeline/" + (key.rsplit("/", 2)[0][-40:] or "unknown")
    return f"pipeline/{ref.name}@{ref.label}"


def _publish_summary(
    settings: Settings,
    dataset: datasets.ResolvedDataset,
    code: ids.CodeVersion,
    run_id: int,
    event_id: str,
    mlflow_run_id: str | None,
    stages: list[tuple[str, str, str]],
) -> None:
    """The run's summary artifact, written whether the run passed every stage or stopped at one."""
    url = None
    if mlflow_run_id is not None:
        experiment = tracking.experiment_id(tracking.client(settings.mlflow.url), settings.mlflow.experiment)
        url = reports.mlflow_run_url(settings.mlflow.url, experiment, mlflow_run_id)
    summary = reports.pipeline_summary(
        dataset=dataset,
        code=code,
        pipeline_run_id=str(run_id),
        event_id=event_id or None,
        mlflow_url=url,
        stages=stages,
    )
    create_markdown_artifact(
        key=_artifact_key(dataset.name), markdown=summary, description=f"pipeline/{dataset.name}@{dataset.data7}"
    )


def _label_run(name: str, tags: list[str]) -> None:
    """Rename the flow run and add tags operators filter on in the UI (dataset, data and code version)."""
    from prefect.client.orchestration import get_client

    run_id = flow_run.get_id()
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(UUID(run_id), name=name, tags=sorted({*flow_run.tags, *tags}))


def _train_and_package(
    settings: Settings,
    store: MetadataStore,
    run_id: int,
    dataset_version_id: int,
    mlflow_run_id: str,
    dataset: datasets.ResolvedDataset,
    manifest: bytes,
    code: ids.CodeVersion,
    baseline: dict[str, Any],
    stages: list[tuple[str, str, str]],
) -> dict[str, str]:
    """Gates 3 and 4, then the model version: train + train gate, convert + parity, package."""
    trained = train_flow.train_model(settings, dataset, manifest, mlflow_run_id)
    verdict = train_flow.check_training(settings, store, run_id, trained)
    gates.publish_verdict(settings, store, run_id=run_id, mlflow_run_id=mlflow_run_id, dataset=dataset, verdict=verdict)
    accuracy = trained.result.best_val_accuracy
    stages.append(
        (
            "train gate",
            "passed" if verdict.passed else "FAILED",
            f"{verdict.reason()}; best val accuracy {accuracy:.3f} at epoch {trained.result.best_epoch}",
        )
    )
    gates.enforce(verdict)

    converted = train_flow.convert_model(settings, trained)
    gates.publish_verdict(
        settings, store, run_id=run_id, mlflow_run_id=mlflow_run_id, dataset=dataset, verdict=converted.verdict
    )
    stages.append(("convert", "passed" if converted.verdict.passed else "FAILED", converted.verdict.reason()))
    gates.enforce(converted.verdict)

    packaged: dict[str, str] = train_flow.package_model(
        settings,
        store,
        run_id=run_id,
        dataset_version_id=dataset_version_id,
        mlflow_run_id=mlflow_run_id,
        dataset=dataset,
        code=code,
        trained=trained,
        converted=converted,
        baseline=baseline,
    )
    return packaged


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
    from sluicegate.metadata import MetadataStore

    logger = get_run_logger()
    settings = Settings()
    store = MetadataStore(settings.metadata_url)
    store.check_schema()
    code = ids.code_version(baked=settings.code_commit)
    parameters = {"bucket": bucket, "key": key, "version_id": version_id, "etag": etag, "event_id": event_id}
    start = record_run_start(store, trigger=trigger, event_id=event_id or None, code=code, parameters=parameters)
    run_id = start.run_id
    if start.busy_with is not None:
        reason = (
            f"flow run {start.busy_with} is already running the pipeline on this dataset version; if its "
            "process is gone, mark it Crashed or Cancelled in the Prefect UI and run this again"
        )
        logger.warning(reason)
        record_finish(store, run_id, "skipped", reason)
        store.dispose()
        skipped = {"pipeline_run_id": run_id, "status": "skipped", "reason": reason}
        return Completed(name="Skipped", message=reason, data=skipped)  # type: ignore[return-value]
    if start.taken_over is not None:
        logger.info(
            "continuing pipeline run %s, abandoned by flow run %s: finished stages are found again, not redone",
            run_id,
            start.taken_over,
        )
    stages: list[tuple[str, str, str]] = []
    mlflow_run_id: str | None = None
    dataset: datasets.ResolvedDataset | None = None
    try:
        dataset, manifest = resolve_dataset(settings, bucket, key, version_id or None)
        stages.append(("resolve dataset", "passed", f"{len(dataset.objects)} objects pinned"))
        _label_run(
            f"pipeline/{dataset.name}@{dataset.data7}",
            [f"dataset:{dataset.name}", f"data:{dataset.data7}", f"code:{code.commit[:7]}"],
        )
        dataset_version_id = record_dataset(store, run_id, dataset)
        mlflow_run_id = track_run(
            settings.mlflow.url,
            settings.mlflow.experiment,
            pipeline_run_id=str(run_id),
            flow_run_id=flow_run.get_id(),
            event_id=event_id or None,
            dataset=dataset,
            manifest=manifest,
            code=code,
        )
        record_mlflow(store, run_id, mlflow_run_id)
        stages.append(("lineage", "recorded", f"MLflow run {mlflow_run_id}"))
        # What the candidate is fed: champions found later through the registry are compared with this.
        log_json(settings.mlflow.url, mlflow_run_id, gates.candidate_spec(settings).to_dict(), PREPROCESSING_ARTIFACT)

        verdict, validation, baseline = gates.data_gate(settings, dataset, manifest)
        gates.publish_verdict(
            settings,
            store,
            run_id=run_id,
            mlflow_run_id=mlflow_run_id,
            dataset=dataset,
            verdict=verdict,
            evidence={"gx_validation": validation},
        )
        stages.append(("data gate", "passed" if verdict.passed else "FAILED", verdict.reason()))
        gates.enforce(verdict)
        log_json(settings.mlflow.url, mlflow_run_id, baseline, "dataset/channel_baseline.json")

        verdict = gates.feature_gate(settings, dataset)
        gates.publish_verdict(
            settings, store, run_id=run_id, mlflow_run_id=mlflow_run_id, dataset=dataset, verdict=verdict
        )
        stages.append(("feature gate", "passed" if verdict.passed else "FAILED", verdict.reason()))
        gates.enforce(verdict)

        earlier = train_flow.find_packaged(settings, code, dataset.data_version, mlflow_run_id)
        if earlier is None:
            packaged = _train_and_package(
                settings, store, run_id, dataset_version_id, mlflow_run_id, dataset, manifest, code, baseline, stages
            )
        else:
            stages.append(("train + convert", "found", f"{Path(earlier).name}, packaged by an earlier attempt"))
            packaged = train_flow.publish_model(
                settings,
                store,
                Path(earlier),
                dataset_version_id=dataset_version_id,
                mlflow_run_id=mlflow_run_id,
                code=code,
            )
        stages.append(
            ("model version", "registered", f"{packaged['model_version']} (registry v{packaged['registry_version']})")
        )

        from tasks.training import labelled_rows

        candidate = registry_version(settings.mlflow.url, settings.model.name, packaged["registry_version"])
        evaluated = eval_flow.evaluate_candidate(settings, dataset, manifest, Path(packaged["repository"]))
        eval_flow.publish_evaluation(
            settings,
            store,
            run_id=run_id,
            mlflow_run_id=mlflow_run_id,
            dataset=dataset,
            evaluated=evaluated,
            candidate=candidate,
            train_images=len(labelled_rows(manifest, "train")),
        )
        passed = evaluated.verdict.passed
        stages.append(
            (
                "eval gate",
                "passed" if passed else "FAILED",
                eval_flow.stage_result(evaluated.verdict, evaluated.evaluations),
            )
        )
        gates.enforce(evaluated.verdict)
        eval_flow.promote_challenger(settings, store, run_id=run_id, candidate=candidate, verdict=evaluated.verdict)
        stages.append(("challenger", "alias set", f"{settings.model.name}@challenger = {candidate.model_version}"))
        if settings.rollout.after_pipeline:
            from flows.rollout import rollout as rollout_flow

            rolled = rollout_flow(settings.model.name, packaged["model_version"], packaged["registry_version"])
            stages.append(("canary", str(rolled["status"]), str(rolled["reason"])))

        result = PipelineResult(
            run_id,
            dataset.name,
            dataset.data_version,
            mlflow_run_id,
            "succeeded",
            packaged["model_version"],
            packaged["registry_version"],
            challenger=True,
        )
        end_tracking(settings.mlflow.url, mlflow_run_id, succeeded=True, summary=asdict(result))
        record_finish(store, run_id, "succeeded", None)
        logger.info("pipeline run %s succeeded for %s@%s", run_id, dataset.name, dataset.data7)
        return asdict(result)
    except Exception as exc:
        logger.error("pipeline run %s failed: %s", run_id, exc)
        record_finish(store, run_id, "failed", f"{type(exc).__name__}: {exc}")
        if mlflow_run_id is not None:
            end_tracking(settings.mlflow.url, mlflow_run_id, succeeded=False)
        raise
    finally:
        if dataset is not None:
            _publish_summary(settings, dataset, code, run_id, event_id, mlflow_run_id, stages)
        store.dispose()
