"""scheduled-retrain in-process against the real services."""

from sqlalchemy import select

from flows.retrain import scheduled_retrain
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.models import PipelineRun
from sluicegate.settings import Settings
from tests.fixtures.platform import upload_dataset


def test_retrain_runs_the_pipeline_on_the_newest_version(platform: Settings) -> None:
    assert scheduled_retrain() is None  # an empty bucket: nothing to do, and no failure
    upload_dataset(platform, "pcb", "2026-11-01", count=6, seed=1)
    newest = upload_dataset(platform, "pcb", "2026-11-02", count=6, seed=2)
    result = scheduled_retrain()
    assert result is not None and result["dataset"] == "pcb"
    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        assert run.trigger == "schedule" and run.status == "succeeded"
        assert run.parameters["key"] == newest and run.parameters["version_id"]
    store.dispose()
