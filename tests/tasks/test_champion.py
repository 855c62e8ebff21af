"""Finding the champion through the MLflow registry alias (a real MLflow server)."""

from __future__ import annotations

from serving.preprocessing import PreprocessSpec
from sluicegate.settings import Settings
from tasks import champion, tracking


def test_no_registered_model_means_no_champion(platform: Settings) -> None:
    assert champion.find_champion(platform.mlflow.url, f"absent-{platform.storage.bucket}") is None


def test_champion_labels_and_preprocessing_come_from_its_run(platform: Settings) -> None:
    client = tracking.client(platform.mlflow.url)
    experiment = tracking.experiment_id(client, platform.mlflow.experiment)
    run = client.create_run(experiment)
    manifest = "path,label,split\n" + "".join(
        f"images/{i}.png,{'good' if i % 4 else 'bridge'},{'train' if i % 5 else 'test'}\n" for i in range(100)
    )
    client.log_text(run.info.run_id, manifest, champion.MANIFEST_ARTIFACT)
    spec = PreprocessSpec(height=32, width=32, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)).to_dict()
    client.log_dict(run.info.run_id, spec, champion.PREPROCESSING_ARTIFACT)
    name = f"model-{platform.storage.bucket}"
    client.create_registered_model(name)
    version = client.create_model_version(
        name,
        source=f"{run.info.artifact_uri}/model",
        run_id=run.info.run_id,
        tags={"sluicegate.model_version": "v1.0.0-abcdef0-1234567"},
    )
    assert champion.find_champion(platform.mlflow.url, name) is None  # registered, but no alias yet
    client.set_registered_model_alias(name, champion.CHAMPION, version.version)

    found = champion.find_champion(platform.mlflow.url, name)
    assert found is not None and found.run_id == run.info.run_id
    assert found.describe() == f"{name} v1.0.0-abcdef0-1234567"
    reference = champion.champion_labels(platform.mlflow.url, found)
    assert reference is not None and reference.closed
    train = [i for i in range(100) if i % 5]
    assert abs(reference.weights["bridge"] - sum(1 for i in train if i % 4 == 0) / len(train)) < 1e-9
    assert "train split" in reference.source
    assert champion.champion_preprocessing(platform.mlflow.url, found) == spec
