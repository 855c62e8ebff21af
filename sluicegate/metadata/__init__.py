"""The metadata (lineage) store: the tables (``models``), the store and its schema check (``store``), and one
module of repository functions per aggregate: ``datasets``, ``events``, ``runs``, ``gates``,
``model_versions`` (with alias moves), ``rollouts``; ``rows`` holds what they share. Only these modules
build queries; everything else calls them with a session from ``MetadataStore.session()``."""

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
