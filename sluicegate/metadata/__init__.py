"""The metadata (lineage) store: models, the store with its migrations, and repository functions."""

from sluicegate.metadata.models import (
    AliasChange,
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
    "AliasChange",
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
