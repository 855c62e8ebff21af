"""Gates 1 and 2 in the pipeline, as Prefect tasks around ``tasks.dataset_gates`` (the same composition
``sluicegate check`` runs); the run context publishes, records and enforces their verdicts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.wrappers import stage
from sluicegate.settings import Settings
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from serving.preprocessing import PreprocessSpec
    from tasks.dataset_gates import DataGateOutcome, DataShape
    from tasks.dataset_source import S3Source


def source_of(settings: Settings, dataset: ResolvedDataset) -> S3Source:
    """The pinned version's bytes as every stage of a run reads them (at the resolved object versions)."""
    from sluicegate import storage
    from tasks.dataset_source import pinned_source

    return pinned_source(storage.s3_client(settings), dataset)


def _data_gate(settings: Settings, dataset: ResolvedDataset, manifest: bytes) -> DataGateOutcome:
    """The verdict, GX validation result, channel baseline (drift monitor) and the images' shape."""
    from tasks.champion import find_champion
    from tasks.dataset_gates import check_data

    champion = find_champion(settings.mlflow.url, settings.model.name)
    return check_data(settings, source_of(settings, dataset), manifest, champion=champion)


def _candidate(settings: Settings, shape: DataShape | None) -> tuple[PreprocessSpec, PreprocessSpec | None]:
    """(the candidate's preprocessing, the champion's): the candidate keeps the champion's input unless
    the model's settings say otherwise; a model's first version fits its data."""
    from tasks.champion import find_champion
    from tasks.dataset_gates import candidate_spec, champion_spec

    reference = champion_spec(settings, find_champion(settings.mlflow.url, settings.model.name))
    return candidate_spec(settings, champion=reference, data=shape), reference


def _feature_gate(
    settings: Settings,
    dataset: ResolvedDataset,
    manifest: bytes,
    candidate: PreprocessSpec,
    reference: PreprocessSpec | None,
) -> GateVerdict:
    from tasks.dataset_gates import check_features

    return check_features(settings, source_of(settings, dataset), manifest, reference=reference, candidate=candidate)


data_gate = stage(_data_gate, "data-gate")
candidate_preprocessing = stage(_candidate, "candidate-preprocessing")
feature_gate = stage(_feature_gate, "feature-gate")
