"""The MLflow model registry side of a model version: its files as run artifacts, a registered
version carrying the version tags, found again (not duplicated) when a crashed run is re-run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tasks import lineage

TAG_MODEL_VERSION = "sluicegate.model_version"
ARTIFACT_PATH = "model"


def find_version(tracking_uri: str, model_name: str, model_version: str) -> str | None:
    """The registry version number already carrying ``model_version``, if any."""
    client = lineage.client(tracking_uri)
    found = client.search_model_versions(f"name = '{model_name}' and tags.`{TAG_MODEL_VERSION}` = '{model_version}'")
    return str(found[0].version) if found else None


def register_version(
    tracking_uri: str, model_name: str, run_id: str, version_dir: Path, tags: Mapping[str, str]
) -> str:
    """Log the repository version folder under the run's ``model/`` and register it; returns the registry version.

    Idempotent: a version whose ``sluicegate.model_version`` tag is already registered is returned as is.
    """
    from mlflow.exceptions import MlflowException

    model_version = tags[TAG_MODEL_VERSION]
    existing = find_version(tracking_uri, model_name, model_version)
    if existing is not None:
        return existing
    client = lineage.client(tracking_uri)
    client.log_artifacts(run_id, str(version_dir), artifact_path=ARTIFACT_PATH)
    try:
        client.create_registered_model(model_name, description="sluicegate: gated models from S3 dataset versions")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    artifact_uri = client.get_run(run_id).info.artifact_uri.rstrip("/")
    created = client.create_model_version(
        model_name,
        source=f"{artifact_uri}/{ARTIFACT_PATH}",
        run_id=run_id,
        tags=dict(tags),
        description=f"{model_version}",
    )
    return str(created.version)
