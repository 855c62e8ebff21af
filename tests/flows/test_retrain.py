"""scheduled-retrain in-process against the real services."""

import httpx
from sqlalchemy import select

from flows.retrain import scheduled_retrain
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.models import PipelineRun
from sluicegate.settings import Settings
from tasks import registry
from tests.fixtures.platform import upload_dataset


def test_retrain_runs_the_newest_version_then_skips_it_once_it_is_champion(platform: Settings) -> None:
    empty = scheduled_retrain()  # an empty bucket: nothing to do, no failure, no row
    assert empty["status"] == "skipped" and empty["models"] == {} and "no dataset" in empty["reason"]
    upload_dataset(platform, "pcb", "2026-11-01", count=6, seed=1)
    newest = upload_dataset(platform, "pcb", "2026-11-02", count=6, seed=2)
    retrained = scheduled_retrain()
    assert retrained["status"] == "succeeded" and list(retrained["models"]) == [platform.model.name]
    result = retrained["models"][platform.model.name]
    assert result["dataset"] == "pcb" and result["status"] == "succeeded"
    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        assert run.trigger == "schedule" and run.status == "succeeded"
        assert run.parameters["key"] == newest and run.parameters["version_id"]
        trained_on = run.dataset_version_id

    # The rollout makes it champion; the next night's run has nothing new to learn from.
    version = registry.get_version(platform.mlflow.url, platform.model.name, result["registry_version"])
    registry.move_alias(platform.mlflow.url, store, version, "champion", actor="test", reason="rolled out")
    all_skipped = scheduled_retrain()
    assert all_skipped["status"] == "skipped"
    skipped = all_skipped["models"][platform.model.name]
    assert result["model_version"] in skipped["reason"] and "already produced the champion" in skipped["reason"]
    with store.session() as session:
        rows = session.scalars(select(PipelineRun).order_by(PipelineRun.id)).all()
        assert len(rows) == 2  # no new training run, one recorded skip
        skip = rows[1]
        assert (skip.trigger, skip.status, skip.reason) == ("schedule", "skipped", skipped["reason"])
        assert skip.dataset_version_id == trained_on and skip.finished_at is not None
        flow_run_id = skip.prefect_flow_run_id
    store.dispose()
    # Operators see it in Prefect: a Completed state named Skipped with the reason, and an artifact.
    state = httpx.get(f"{platform.prefect.url}/flow_runs/{flow_run_id}").json()["state"]
    assert (state["type"], state["name"]) == ("COMPLETED", "Skipped") and "champion" in state["message"]


def test_retrain_is_per_model_each_on_the_newest_version_of_its_own_datasets(platform: Settings) -> None:
    upload_dataset(platform, "pcb", "2026-11-01", count=6, seed=1)
    upload_dataset(platform, "lines", "2026-11-03", count=6, seed=2)  # newer, but another model's
    pcb, lines = platform.model.name, platform.model.prefix + "lines"
    only = scheduled_retrain(model=pcb)
    assert list(only["models"]) == [pcb] and only["models"][pcb]["dataset"] == "pcb"
    both = scheduled_retrain()
    assert sorted(both["models"]) == sorted([pcb, lines])
    assert both["models"][lines]["dataset"] == "lines" and both["models"][pcb]["dataset"] == "pcb"
    for name in (pcb, lines):
        assert registry.list_versions(platform.mlflow.url, name)  # each model got its own registry entry
