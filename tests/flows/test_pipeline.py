"""The pipeline flow in-process against real services: Prefect server, moto S3, MLflow, PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select

from flows.pipeline import pipeline
from serving.preprocessing import PreprocessSpec
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.models import DatasetVersion, PipelineRun
from sluicegate.settings import Settings
from tasks import tracking
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
    key = upload_dataset(pg_platform, "pcb", "2026-11-29", count=6)
    result = pipeline(bucket=pg_platform.storage.bucket, key=key, trigger="manual")
    store = MetadataStore(pg_platform.metadata_url)
    with store.session() as session:
        run = session.get(PipelineRun, result["pipeline_run_id"])
        assert run is not None and run.status == "succeeded" and run.trigger == "manual"
        assert run.mlflow_run_id == result["mlflow_run_id"] and run.prefect_flow_run_id
        version = session.scalars(select(DatasetVersion)).one()
        assert version.data_version == result["data_version"] and version.num_objects == 6
        assert run.dataset_version_id == version.id
    store.dispose()
    tracked = tracking.client(pg_platform.mlflow.url).get_run(result["mlflow_run_id"])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.tags[tracking.TAG_DATA_VERSION] == result["data_version"]
    assert len(tracked.data.tags[tracking.TAG_CODE_VERSION]) in (40, len("unknown"))
    assert tracked.inputs.dataset_inputs[0].dataset.digest == result["data_version"][:7]


def test_a_passing_run_registers_a_traceable_model_version(pg_platform: Settings) -> None:
    """Gates 3-4 and packaging: repository folder, registry version with every tag, metadata row."""
    from serving.model_format import verify_version
    from sluicegate.metadata.models import ModelVersion
    from tasks import registry

    key = upload_dataset(pg_platform, "pcb", "model", count=12)
    result = pipeline(bucket=pg_platform.storage.bucket, key=key, trigger="manual")
    version = result["model_version"]
    assert version.startswith("v1.0.0-") and version.endswith(result["data_version"][:7])
    store = MetadataStore(pg_platform.metadata_url)
    with store.session() as session:
        row = session.scalars(select(ModelVersion).where(ModelVersion.version == version)).one()
        assert row.data_version == result["data_version"] and row.mlflow_run_id == result["mlflow_run_id"]
        assert {"model.onnx", "config.json", "checkpoint.safetensors"} <= set(row.artifacts)
        assert "torch" in row.environment and "onnxruntime" in row.environment
        gates = {
            g.gate: g.passed
            for g in __import__("sluicegate.metadata.gates", fromlist=["x"]).gate_results_for_run(
                session, result["pipeline_run_id"]
            )
        }
        registry_version = row.mlflow_model_version
    store.dispose()
    assert gates == {"data": True, "feature": True, "train": True, "convert": True, "eval": True}
    config = verify_version(pg_platform.home / "repository" / pg_platform.model.name / version)
    assert config.lineage["sluicegate.data_version"] == result["data_version"]
    client = tracking.client(pg_platform.mlflow.url)
    registered = client.get_model_version(pg_platform.model.name, registry_version)
    for tag in (
        "sluicegate.model_version",
        "sluicegate.data_version",
        "sluicegate.code_version",
        "sluicegate.mlflow_run_id",
        "sluicegate.pipeline_run_id",
    ):
        assert registered.tags.get(tag), tag
    assert registry.find_version(pg_platform.mlflow.url, pg_platform.model.name, version) == registry_version
    artifacts = {a.path for a in client.list_artifacts(result["mlflow_run_id"], "model")}
    assert "model/model.onnx" in artifacts and "model/SHA256SUMS" in artifacts
    # A retrain on the same dataset version and commit is a new build: PATCH goes up, nothing is overwritten.
    again = pipeline(bucket=pg_platform.storage.bucket, key=key, trigger="manual")
    assert again["model_version"] == version.replace("v1.0.0-", "v1.0.1-", 1)
    assert verify_version(pg_platform.home / "repository" / pg_platform.model.name / version).version == version
    client.delete_registered_model(pg_platform.model.name)


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


def _gate_rows(settings: Settings, run_id: int) -> dict[str, bool]:
    from sluicegate.metadata.gates import gate_results_for_run

    store = MetadataStore(settings.metadata_url)
    with store.session() as session:
        rows = {row.gate: row.passed for row in gate_results_for_run(session, run_id)}
    store.dispose()
    return rows


def _prefect_artifact_keys(api: str, flow_run_id: str) -> set[str]:
    import httpx

    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"] for a in found.json()}


def test_a_sample_dataset_passes_both_gates_with_reports(platform: Settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tasks.sample_data import make_sample
    from tasks.transfer import push_directory

    make_sample(tmp_path / "data", count=120, seed=5)
    pushed = push_directory(platform, tmp_path / "data", "pcb", "good")
    result = pipeline(bucket=platform.storage.bucket, key=pushed.manifest_key, trigger="manual")
    assert _gate_rows(platform, result["pipeline_run_id"]) == {
        "data": True,
        "feature": True,
        "train": True,
        "convert": True,
        "eval": True,
    }
    client = tracking.client(platform.mlflow.url)
    names = {a.path for a in client.list_artifacts(result["mlflow_run_id"], "gates/data")}
    assert {"gates/data/gx_validation.json", "gates/data/report.md", "gates/data/verdict.json"} <= names
    top = {a.path for a in client.list_artifacts(result["mlflow_run_id"])}
    assert "preprocessing.json" in top
    baseline = client.download_artifacts(result["mlflow_run_id"], "dataset/channel_baseline.json", str(tmp_path))
    assert len(json.loads(Path(baseline).read_text())["r"]) == 120
    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        flow_run_id = session.get(PipelineRun, result["pipeline_run_id"]).prefect_flow_run_id  # type: ignore[union-attr]
    store.dispose()
    assert {"data-gate-pcb", "feature-gate-pcb", "pipeline-pcb"} <= _prefect_artifact_keys(
        platform.prefect.url, flow_run_id
    )


def test_a_corrupt_dataset_stops_at_the_data_gate(platform: Settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sluicegate.errors import GateFailed
    from tasks.sample_data import Corruption, make_sample
    from tasks.transfer import push_directory

    make_sample(tmp_path / "data", count=120, seed=5, corrupt=Corruption.UNDECODABLE)
    pushed = push_directory(platform, tmp_path / "data", "pcb", "broken")
    with pytest.raises(GateFailed, match=r"data gate failed: images decode observed"):
        pipeline(bucket=platform.storage.bucket, key=pushed.manifest_key, trigger="manual")
    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        assert run.status == "failed" and "images decode" in (run.reason or "")
        mlflow_run_id = run.mlflow_run_id
    store.dispose()
    assert _gate_rows(platform, run.id) == {"data": False}  # nothing downstream ran
    tracked = tracking.client(platform.mlflow.url).get_run(mlflow_run_id)  # type: ignore[arg-type]
    assert tracked.info.status == "FAILED" and tracked.data.tags["sluicegate.gate.data"] == "failed"


def test_a_champion_with_other_preprocessing_fails_the_feature_gate(  # type: ignore[no-untyped-def]
    platform: Settings, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluicegate.errors import GateFailed
    from tasks import champion
    from tasks.sample_data import make_sample
    from tasks.transfer import push_directory

    make_sample(tmp_path / "data", count=60, seed=6)
    pushed = push_directory(platform, tmp_path / "data", "pcb", "v2")
    client = tracking.client(platform.mlflow.url)
    run = client.create_run(tracking.experiment_id(client, platform.mlflow.experiment))
    client.create_registered_model(platform.model.name)
    bgr = PreprocessSpec(height=32, width=32, colour="BGR").to_dict()
    client.log_dict(run.info.run_id, bgr, champion.PREPROCESSING_ARTIFACT)
    version = client.create_model_version(
        platform.model.name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    client.set_registered_model_alias(platform.model.name, champion.CHAMPION, version.version)
    # A candidate keeps its champion's input unless the settings (or the model's spec) pin a field:
    # pinning RGB against a BGR champion is the change the feature gate exists to catch.
    monkeypatch.setenv("SLUICEGATE_PREPROCESSING__COLOUR", "RGB")
    try:
        with pytest.raises(GateFailed, match=r"feature gate failed: cosine p5 observed"):
            pipeline(bucket=platform.storage.bucket, key=pushed.manifest_key, trigger="manual")
    finally:
        client.delete_registered_model(platform.model.name)
