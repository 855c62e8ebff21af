"""Gates 1 and 2 in the pipeline, as Prefect tasks around ``tasks.dataset_gates`` (the same composition
``sluicegate check`` runs); the run context publishes, records and enforces their verdicts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flows.wrappers import stage
from sluicegate.settings import Settings
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from tasks.dataset_source import S3Source


def source_of(settings: Settings, dataset: ResolvedDataset) -> S3Source:
    """The pinned version's bytes as every stage of a run reads them (at the resolved object versions)."""
    from sluicegate import storage
    from tasks.dataset_source import pinned_source

    return pinned_source(storage.s3_client(settings), dataset)


def _data_gate(
    settings: Settings, dataset: ResolvedDataset, manifest: bytes
) -> tuple[GateVerdict, dict[str, Any], dict[str, Any]]:
    """Returns (verdict, GX validation result, channel baseline for the drift monitor)."""
    from tasks.champion import find_champion
    from tasks.dataset_gates import check_data

    champion = find_champion(settings.mlflow.url, settings.model.name)
    outcome = check_data(settings, source_of(settings, dataset), manifest, champion=champion)
    return outcome.verdict, outcome.validation, outcome.baseline


def _feature_gate(settings: Settings, dataset: ResolvedDataset, manifest: bytes) -> GateVerdict:
    from tasks.champion import find_champion
    from tasks.dataset_gates import champion_spec, check_features

    reference = champion_spec(settings, find_champion(settings.mlflow.url, settings.model.name))
    return check_features(settings, source_of(settings, dataset), manifest, reference=reference)


data_gate = stage(_data_gate, "data-gate")
feature_gate = stage(_feature_gate, "feature-gate")
