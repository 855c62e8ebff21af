"""Scheduled retraining: the pipeline again on the newest dataset version in the bucket."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.pipeline import pipeline
from flows.wrappers import stage
from sluicegate import storage
from sluicegate.settings import Settings
from tasks import datasets


def _newest(settings: Settings) -> tuple[str, str | None] | None:
    return datasets.newest_manifest(
        storage.s3_client(settings), settings.storage.bucket, settings.storage.datasets_prefix
    )


find_newest = stage(_newest, "find-newest-dataset")


@flow(name="scheduled-retrain", log_prints=True)
def scheduled_retrain() -> dict[str, Any] | None:
    """Re-run the pipeline on the newest dataset version; nothing to do when the bucket has none."""
    logger = get_run_logger()
    settings = Settings()
    newest = find_newest(settings)
    if newest is None:
        logger.info(
            "no dataset manifest under s3://%s/%s: nothing to retrain",
            settings.storage.bucket,
            settings.storage.datasets_prefix,
        )
        return None
    key, version_id = newest
    logger.info("retraining on s3://%s/%s (version %s)", settings.storage.bucket, key, version_id or "latest")
    result: dict[str, Any] = pipeline(
        bucket=settings.storage.bucket, key=key, version_id=version_id or "", trigger="schedule"
    )
    return result
