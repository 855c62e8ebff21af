"""The metadata (lineage) store: models, the store with its migrations, and repository functions."""

from sluicegate.metadata.models import (
    Base,
    Dataset,
    DatasetVersion,
    DeadLetter,
    Deployment,
    GateResult,
    ModelVersion,
    PipelineRun,
    RolloutStep,
    S3Event,
)
from sluicegate.metadata.store import MetadataStore

__all__ = [
    "Base",
    "Dataset",
    "DatasetVersion",
    "DeadLetter",
    "Deployment",
    "GateResult",
    "MetadataStore",
    "ModelVersion",
    "PipelineRun",
    "RolloutStep",
    "S3Event",
]
