"""The pipeline flow in-process against real services: Prefect server, moto S3, MLflow, PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from flows.pipeline import pipeline
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.models import DatasetVersion, PipelineRun
from sluicegate.settings import Settings
from tasks import lineage
from tests.fixtures.platform import upload_dataset


@pytest.fixture
def pg_platform(platform: Settings, fresh_postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The platform with its metadata in a real PostgreSQL database."""
    monkeypatch.setenv("SLUICEGATE_METADATA__URL", fresh_postgres_url)
    store = MetadataStore(fresh_postgres_url)
    store.upgrade()
    store.dispose()
    return Settings()


def test_pipeline_records_lineage(pg_platform: Settings) -> None:
    key = upload_dataset(pg_platform, "pcb", "2026-11-29", count=4)
    result = pipeline(bucket=pg_platform.storage.bucket, key=key, trigger="manual")
    store = MetadataStore(pg_platform.metadata_url)
    with store.session() as session:
        run = session.get(PipelineRun, result["pipeline_run_id"])
        assert run is not None and run.status == "succeeded" and run.trigger == "manual"
        assert run.mlflow_run_id == result["mlflow_run_id"] and run.prefect_flow_run_id
        version = session.scalars(select(DatasetVersion)).one()
        assert version.data_version == result["data_version"] and version.num_objects == 4
        assert run.dataset_version_id == version.id
    store.dispose()
    tracked = lineage.client(pg_platform.mlflow.url).get_run(result["mlflow_run_id"])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.tags[lineage.TAG_DATA_VERSION] == result["data_version"]
    assert len(tracked.data.tags[lineage.TAG_CODE_VERSION]) in (40, len("unknown"))
    assert tracked.inputs.dataset_inputs[0].dataset.digest == result["data_version"][:7]


def test_a_broken_dataset_fails_the_run_with_the_reason(pg_platform: Settings) -> None:
    from sluicegate import storage
    from tests.fixtures.platform import manifest_for

    key = "datasets/pcb/broken/manifest.csv"
    storage.s3_client(pg_platform).put_object(
        Bucket=pg_platform.storage.bucket, Key=key, Body=manifest_for(["images/missing.png"])
    )
    with pytest.raises(Exception, match="do not exist"):
        pipeline(bucket=pg_platform.storage.bucket, key=key, trigger="manual")
    store = MetadataStore(pg_platform.metadata_url)
    with store.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        assert run.status == "failed" and "images/missing.png" in (run.reason or "")
        assert run.dataset_version_id is None
    store.dispose()
