"""The current champion, found through the MLflow registry alias, and what gates compare against it:
its training labels (data gate) and its preprocessing (feature gate)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tasks import tracking
from tasks.data_gate import LabelReference, read_manifest_frame
from tasks.registry import CHAMPION, alias_holder

PREPROCESSING_ARTIFACT = "preprocessing.json"
MANIFEST_ARTIFACT = "dataset/manifest.csv"


@dataclass(frozen=True)
class Champion:
    model_name: str
    registry_version: str
    run_id: str
    model_version: str  # sluicegate's vX.Y.Z-<commit7>-<data7>, from the version's tags when present

    def describe(self) -> str:
        return f"{self.model_name} {self.model_version or 'v' + self.registry_version}"


def find_champion(tracking_uri: str, model_name: str) -> Champion | None:
    """The registered model version holding the ``champion`` alias, or None (no model yet)."""
    found = alias_holder(tracking_uri, model_name, CHAMPION)
    if found is None:
        return None
    return Champion(model_name, found.registry_version, found.run_id, found.model_version)


def _artifact(tracking_uri: str, run_id: str, path: str) -> bytes | None:
    from mlflow.exceptions import MlflowException

    client = tracking.client(tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(run_id, path, tmp)
        except (MlflowException, OSError):
            return None
        return Path(local).read_bytes()


def champion_labels(tracking_uri: str, champion: Champion) -> LabelReference | None:
    """The label distribution of the champion's training split (from its run's manifest artifact)."""
    manifest = _artifact(tracking_uri, champion.run_id, MANIFEST_ARTIFACT)
    if manifest is None:
        return None
    frame = read_manifest_frame(manifest)
    train = [label for label, split in zip(frame["label"], frame["split"], strict=True) if split == "train" and label]
    return LabelReference.from_labels(train, f"champion {champion.describe()} (train split)")


def champion_preprocessing(tracking_uri: str, champion: Champion) -> dict[str, object] | None:
    """The preprocessing spec (as recorded) the champion was trained and is served with."""
    raw = _artifact(tracking_uri, champion.run_id, PREPROCESSING_ARTIFACT)
    return None if raw is None else dict(json.loads(raw))
