"""Scheduled retraining's one decision: is there a dataset version the champion was not trained on?"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluicegate import ids
from tasks import datasets
from tasks.registry import CHAMPION, alias_holder

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

TAG_DATA_VERSION = "sluicegate.data_version"


@dataclass(frozen=True)
class NewestDataset:
    key: str
    version_id: str | None
    data_version: str

    @property
    def data7(self) -> str:
        return self.data_version[: ids.SHORT]


@dataclass(frozen=True)
class RetrainDecision:
    retrain: bool
    reason: str
    newest: NewestDataset | None


def _pinned(s3: S3Client, bucket: str, key: str, version_id: str | None) -> NewestDataset:
    # Read the version just listed, so a manifest written meanwhile cannot swap the bytes hashed.
    manifest, _, version = datasets.read_manifest(s3, bucket, key, version_id)
    return NewestDataset(key, version or version_id, ids.data_version(manifest))


def newest_per_model(
    s3: S3Client, bucket: str, datasets_prefix: str, model_of: Callable[[str], str]
) -> dict[str, NewestDataset]:
    """Each model's newest dataset version: the newest manifest among the datasets that feed it.

    Args:
        model_of: dataset name -> the model it trains (``sluicegate.model_specs.model_for_dataset``).
    """
    chosen: dict[str, tuple[Any, str]] = {}
    for name, (modified, key) in datasets.newest_manifests(s3, bucket, datasets_prefix).items():
        model = model_of(name)
        if model not in chosen or (modified, key) > chosen[model]:
            chosen[model] = (modified, key)
    return {
        model: _pinned(s3, bucket, key, datasets.manifest_version_id(s3, bucket, key))
        for model, (_, key) in sorted(chosen.items())
    }


def champion_data_version(tracking_uri: str, model_name: str) -> tuple[str, str] | None:
    """(model version, data version) of the champion, or None when there is no champion or it is untagged."""
    holder = alias_holder(tracking_uri, model_name, CHAMPION)
    if holder is None or not holder.tags.get(TAG_DATA_VERSION):
        return None
    return holder.model_version or f"registry v{holder.registry_version}", holder.tags[TAG_DATA_VERSION]


def decide(newest: NewestDataset | None, champion: tuple[str, str] | None, *, force: bool = False) -> RetrainDecision:
    """Retrain unless there is no dataset, or the newest one already produced the champion.

    Args:
        newest: The newest dataset version in the bucket.
        champion: (model version, data version) of the current champion.
        force: Retrain even on the champion's own data (a code or settings change worth a new build).
    """
    if newest is None:
        return RetrainDecision(False, "no dataset manifest in the bucket: nothing to retrain", None)
    if champion is not None and champion[1] == newest.data_version and not force:
        return RetrainDecision(
            False,
            f"the newest dataset version {newest.data7} ({newest.key}) already produced the champion "
            f"{champion[0]}; pass force=true to retrain anyway",
            newest,
        )
    base = "no champion yet" if champion is None else f"the champion {champion[0]} was trained on other data"
    return RetrainDecision(True, f"{base}: retraining on {newest.data7} ({newest.key})", newest)
