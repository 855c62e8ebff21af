"""Scheduled retraining: the pipeline again on the newest dataset version in the bucket, unless that
version already produced the champion (then the skip and its reason are recorded, not silently dropped)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import State, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed

from flows.pipeline import pipeline
from flows.wrappers import stage
from sluicegate import ids, storage
from sluicegate.settings import Settings
from tasks import retrain


def _newest(settings: Settings) -> retrain.NewestDataset | None:
    s3 = storage.s3_client(settings)
    return retrain.newest_dataset(s3, settings.storage.bucket, settings.storage.datasets_prefix)


def _record_skip(settings: Settings, decision: retrain.RetrainDecision) -> int:
    """A pipeline-run row with status ``skipped``, linked to the dataset version, so lineage shows it."""
    from sluicegate.metadata import MetadataStore, runs

    code = ids.code_version(baked=settings.code_commit)
    newest = decision.newest
    with MetadataStore.checked(settings.metadata_url) as store:
        return runs.record_skipped_run(
            store,
            flow_run_id=flow_run.get_id(),
            trigger="schedule",
            code_commit=code.commit,
            code_dirty=code.dirty,
            parameters={"key": newest.key if newest else "", "version_id": newest.version_id if newest else ""},
            data_version=newest.data_version if newest else None,
            reason=decision.reason,
        )


find_newest = stage(_newest, "find-newest-dataset")
champion_data = stage(retrain.champion_data_version, "champion-data-version")
record_skip = stage(_record_skip, "record-skip")


def _run_name() -> str:
    when: datetime = flow_run.scheduled_start_time
    return "scheduled-retrain/" + when.strftime("%Y-%m-%dT%H%M")


@flow(name="scheduled-retrain", flow_run_name=_run_name, log_prints=True)
def scheduled_retrain(force: bool = False) -> dict[str, Any] | State:
    """Re-run the pipeline on the newest dataset version.

    Args:
        force: Retrain even when the newest dataset version already produced the champion.

    Returns:
        The pipeline's result; or, when skipped, a Completed state named "Skipped" carrying the reason.
    """
    logger = get_run_logger()
    settings = Settings()
    newest = find_newest(settings)
    champion = champion_data(settings.mlflow.url, settings.model.name) if newest is not None else None
    decision = retrain.decide(newest, champion, force=force)
    logger.info(decision.reason)
    if not decision.retrain:
        run_id = record_skip(settings, decision) if decision.newest is not None else None
        create_markdown_artifact(
            key="scheduled-retrain",
            markdown=f"## Scheduled retrain skipped\n\n{decision.reason}\n\nPipeline run row: {run_id or '-'}",
            description="scheduled-retrain: skipped",
        )
        skipped = {"status": "skipped", "reason": decision.reason, "pipeline_run_id": run_id}
        return Completed(name="Skipped", message=decision.reason, data=skipped)
    assert decision.newest is not None
    target = decision.newest
    logger.info("retraining on s3://%s/%s (version %s)", settings.storage.bucket, target.key, target.version_id)
    result: dict[str, Any] = pipeline(
        bucket=settings.storage.bucket, key=target.key, version_id=target.version_id or "", trigger="schedule"
    )
    return result
