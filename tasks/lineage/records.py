"""What a lineage walk returns (``tasks/lineage/walk.py``): frozen records, rendered by the CLI as a tree
or as one JSON document (field names are the JSON keys, so renaming one is a breaking change)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from tasks.lineage.request_logs import RequestLine

Kind = Literal["request", "model", "data"]


@dataclass(frozen=True)
class MlflowState:
    """Whether the tracking server answered; when not, the walk shows what the metadata store knows."""

    url: str
    reachable: bool
    error: str | None = None


@dataclass(frozen=True)
class S3Object:
    path: str
    version_id: str | None
    etag: str | None
    size: int | None


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset version; ``objects`` is None unless asked for (``--objects``), ``num_objects`` always set."""

    name: str
    data_version: str
    bucket: str
    prefix: str
    manifest_key: str
    manifest_version_id: str | None
    manifest_etag: str
    num_objects: int
    objects: tuple[S3Object, ...] | None
    created_at: datetime


@dataclass(frozen=True)
class S3EventInfo:
    """The S3 notification that triggered a pipeline run (through the event bridge)."""

    event_id: str
    source: str
    bucket: str
    key: str
    version_id: str | None
    etag: str
    event_time: datetime | None
    received_at: datetime


@dataclass(frozen=True)
class CheckInfo:
    name: str
    passed: bool
    observed: Any
    threshold: Any


@dataclass(frozen=True)
class GateInfo:
    gate: str
    passed: bool
    report_uri: str | None
    checks: tuple[CheckInfo, ...]
    recorded_at: datetime


@dataclass(frozen=True)
class PipelineRunInfo:
    id: int
    prefect_flow_run_id: str | None
    trigger: str
    trigger_event: S3EventInfo | None
    trigger_event_id: str | None
    status: str
    reason: str | None
    code_version: str
    code_dirty: bool
    mlflow_run_id: str | None
    started_at: datetime
    finished_at: datetime | None
    gates: tuple[GateInfo, ...]


@dataclass(frozen=True)
class TrainingRun:
    """The MLflow run of a pipeline run: a summary, not every logged value."""

    run_id: str
    url: str
    status: str
    best_val_accuracy: float | None
    params: dict[str, str]
    metrics: dict[str, float]  # the latest value of each
    tags: dict[str, str]  # the sluicegate.* ones


@dataclass(frozen=True)
class RolloutStepInfo:
    step_index: int
    canary_weight: int
    stable_weight: int
    decision: str
    reason: str | None


@dataclass(frozen=True)
class DeploymentInfo:
    id: int
    platform: str
    target: str
    status: str
    reason: str | None
    started_at: datetime
    finished_at: datetime | None
    steps: tuple[RolloutStepInfo, ...]


@dataclass(frozen=True)
class AliasMove:
    """One move of an alias onto (``direction`` "to") or off (``"from"``) the model version."""

    alias: str
    direction: Literal["to", "from"]
    registry_version: str | None
    model_version: str | None
    previous_model_version: str | None
    actor: str
    reason: str
    at: datetime


@dataclass(frozen=True)
class ModelRecord:
    """A model version and what happened to it after it was built (deployments, alias moves).

    ``aliases`` are the ones it holds now: from MLflow (``aliases_source`` "mlflow"), or, with MLflow
    down, from the last recorded move of each alias (``"metadata store"``).
    """

    model_name: str
    version: str
    registry_version: str | None
    mlflow_run_id: str
    code_version: str
    data_version: str
    pipeline_run_id: int | None
    created_at: datetime
    aliases: tuple[str, ...]
    aliases_source: str
    deployments: tuple[DeploymentInfo, ...]
    alias_moves: tuple[AliasMove, ...]


@dataclass(frozen=True)
class ModelLineage:
    """A model version down to its data, code and environment, and up to its deployments."""

    model: ModelRecord
    code_dirty: bool | None
    environment: dict[str, Any]
    artifacts: dict[str, str]
    pipeline_run: PipelineRunInfo | None
    training_run: TrainingRun | None
    dataset: DatasetInfo | None


@dataclass(frozen=True)
class DataLineage:
    """A dataset version up to every run that used it and every model trained on it."""

    dataset: DatasetInfo
    pipeline_runs: tuple[PipelineRunInfo, ...]
    models: tuple[ModelRecord, ...]
    champion: str | None  # the one of ``models`` holding ``champion`` now, if any


@dataclass(frozen=True)
class Lineage:
    """The answer to ``sluicegate lineage REF``: which kind REF was, and the walk from it."""

    kind: Kind
    query: str
    mlflow: MlflowState
    request: RequestLine | None = None
    model: ModelLineage | None = None
    data: DataLineage | None = None
    notes: tuple[str, ...] = ()
