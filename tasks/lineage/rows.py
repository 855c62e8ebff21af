"""Turning metadata-store rows (and their MLflow runs) into lineage records: the steps of a walk.

``Walker`` holds one walk's session, MLflow client and notes; ``tasks/lineage/walk.py`` decides where a
walk starts. Every MLflow call is optional: with no client, or a call that fails, the record leaves the
MLflow part out and a note says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from sluicegate.metadata import (
    AliasChange,
    DatasetVersion,
    Deployment,
    GateResult,
    ModelVersion,
    PipelineRun,
    S3Event,
)
from sluicegate.metadata.events import find_s3_event
from sluicegate.metadata.gates import gate_results_for_run
from sluicegate.metadata.model_versions import (
    alias_changes_for_model_version,
    alias_history,
    model_versions_for_dataset_version,
)
from sluicegate.metadata.rollouts import deployments_for_model_version
from sluicegate.metadata.runs import pipeline_runs_for_dataset_version
from tasks.lineage import records as rec

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"


def _mlflow_failures() -> tuple[type[BaseException], ...]:
    """What a call to a tracking server that went away or refuses raises."""
    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException

    return (MlflowException, RequestException, OSError)


class Walker:
    """One walk: a session, an optional MLflow client, and the notes gathered on the way."""

    def __init__(self, session: Session, tracker: MlflowClient | None, tracking_uri: str, with_objects: bool) -> None:
        self.session = session
        self.tracker = tracker
        self.tracking_uri = tracking_uri
        self.with_objects = with_objects
        self.notes: list[str] = []
        self._held: dict[str, dict[str, str] | None] = {}

    # --- downward: model version -> run -> dataset --------------------------------------------------

    def model(self, row: ModelVersion) -> rec.ModelLineage:
        run = self.pipeline_run(row.pipeline_run) if row.pipeline_run is not None else None
        training = self.training_run(row.mlflow_run_id)
        dirty = run.code_dirty if run is not None else None
        if dirty is None and training is not None and "sluicegate.code_dirty" in training.tags:
            dirty = training.tags["sluicegate.code_dirty"] == "true"
        dataset = row.dataset_version or (row.pipeline_run.dataset_version if row.pipeline_run else None)
        return rec.ModelLineage(
            model=self.record(row),
            code_dirty=dirty,
            environment=dict(row.environment),
            artifacts=dict(row.artifacts),
            pipeline_run=run,
            training_run=training,
            dataset=self.dataset(dataset) if dataset is not None else None,
        )

    def pipeline_run(self, run: PipelineRun) -> rec.PipelineRunInfo:
        event = find_s3_event(self.session, run.trigger_event_id) if run.trigger_event_id else None
        return rec.PipelineRunInfo(
            id=run.id,
            prefect_flow_run_id=run.prefect_flow_run_id,
            trigger=run.trigger,
            trigger_event=_event(event) if event is not None else None,
            trigger_event_id=run.trigger_event_id,
            status=run.status,
            reason=run.reason,
            code_version=run.code_version,
            code_dirty=run.code_dirty,
            mlflow_run_id=run.mlflow_run_id,
            started_at=run.started_at,
            finished_at=run.finished_at,
            gates=tuple(_gate(g) for g in gate_results_for_run(self.session, run.id)),
        )

    def training_run(self, run_id: str) -> rec.TrainingRun | None:
        if self.tracker is None or not run_id:
            return None
        from tasks.reports import mlflow_run_url

        try:
            run = self.tracker.get_run(run_id)
            history = self.tracker.get_metric_history(run_id, "val_accuracy")
        except _mlflow_failures() as exc:
            self.notes.append(f"MLflow run {run_id} could not be read: {exc}")
            return None
        metrics = {str(k): float(v) for k, v in run.data.metrics.items()}
        best = max((float(m.value) for m in history), default=metrics.get("val_accuracy"))
        params = {str(k): str(v) for k, v in run.data.params.items()}
        tags = {str(k): str(v) for k, v in run.data.tags.items() if str(k).startswith("sluicegate.")}
        return rec.TrainingRun(
            run_id=run_id,
            url=mlflow_run_url(self.tracking_uri, str(run.info.experiment_id), run_id),
            status=str(run.info.status),
            best_val_accuracy=best,
            params=dict(sorted(params.items())),
            metrics=dict(sorted(metrics.items())),
            tags=dict(sorted(tags.items())),
        )

    def dataset(self, version: DatasetVersion) -> rec.DatasetInfo:
        objects = None
        if self.with_objects:
            objects = tuple(
                rec.S3Object(path, meta.get("version_id"), meta.get("etag"), meta.get("size"))
                for path, meta in sorted(version.objects.items())
            )
        return rec.DatasetInfo(
            name=version.dataset.name,
            data_version=version.data_version,
            bucket=version.bucket,
            prefix=version.prefix,
            manifest_key=version.manifest_key,
            manifest_version_id=version.manifest_version_id,
            manifest_etag=version.manifest_etag,
            num_objects=version.num_objects,
            objects=objects,
            created_at=version.created_at,
        )

    # --- upward: model version -> deployments, aliases; dataset -> runs, models --------------------

    def record(self, row: ModelVersion) -> rec.ModelRecord:
        deployments = deployments_for_model_version(self.session, row.id)
        aliases, source = self.aliases(row)
        return rec.ModelRecord(
            model_name=row.model_name,
            version=row.version,
            registry_version=row.mlflow_model_version,
            mlflow_run_id=row.mlflow_run_id,
            code_version=row.code_version,
            data_version=row.data_version,
            pipeline_run_id=row.pipeline_run_id,
            created_at=row.created_at,
            aliases=aliases,
            aliases_source=source,
            deployments=tuple(_deployment(d) for d in deployments),
            alias_moves=tuple(self.alias_moves(row)),
        )

    def aliases(self, row: ModelVersion) -> tuple[tuple[str, ...], str]:
        """The aliases ``row`` holds now: MLflow's view, or the last recorded move of each alias."""
        held = self._mlflow_aliases(row.model_name)
        if held is not None:
            return tuple(sorted(a for a, n in held.items() if n == row.mlflow_model_version)), "mlflow"
        latest: dict[str, AliasChange] = {}
        for move in alias_history(self.session, row.model_name, limit=None):
            latest.setdefault(move.alias, move)
        mine = (a for a, m in latest.items() if m.registry_version is not None and _names(m, row))
        return tuple(sorted(mine)), "metadata store"

    def _mlflow_aliases(self, model_name: str) -> dict[str, str] | None:
        if self.tracker is None:
            return None
        if model_name not in self._held:
            try:
                found = self.tracker.get_registered_model(model_name).aliases or {}
                self._held[model_name] = {str(a): str(n) for a, n in found.items()}
            except _mlflow_failures() as exc:
                self.notes.append(f"aliases of {model_name} could not be read from MLflow: {exc}")
                self._held[model_name] = None
        return self._held[model_name]

    def alias_moves(self, row: ModelVersion) -> list[rec.AliasMove]:
        moves = alias_changes_for_model_version(self.session, row)
        return [_move(m, "to" if _names(m, row) else "from") for m in moves]

    def data(self, version: DatasetVersion) -> rec.DataLineage:
        runs = [self.pipeline_run(r) for r in pipeline_runs_for_dataset_version(self.session, version.id)]
        records = [self.record(m) for m in model_versions_for_dataset_version(self.session, version)]
        champion = next((r.version for r in records if CHAMPION in r.aliases), None)
        return rec.DataLineage(self.dataset(version), tuple(runs), tuple(records), champion)


def _names(move: AliasChange, row: ModelVersion) -> bool:
    """Whether ``move`` put its alias on ``row`` (by model version, or registry number when untagged)."""
    if move.model_version is not None:
        return move.model_version == row.version
    return move.registry_version is not None and move.registry_version == row.mlflow_model_version


def _event(event: S3Event) -> rec.S3EventInfo:
    return rec.S3EventInfo(
        event_id=event.event_id,
        source=event.source,
        bucket=event.bucket,
        key=event.key,
        version_id=event.version_id,
        etag=event.etag,
        event_time=event.event_time,
        received_at=event.received_at,
    )


def _gate(result: GateResult) -> rec.GateInfo:
    checks = result.metrics.get("checks") if isinstance(result.metrics, dict) else None
    return rec.GateInfo(
        gate=result.gate,
        passed=result.passed,
        report_uri=result.report_uri,
        checks=tuple(
            rec.CheckInfo(str(c.get("name")), bool(c.get("passed")), c.get("observed"), c.get("threshold"))
            for c in (checks if isinstance(checks, list) else [])
            if isinstance(c, dict)
        ),
        recorded_at=result.created_at,
    )


def _deployment(row: Deployment) -> rec.DeploymentInfo:
    return rec.DeploymentInfo(
        id=row.id,
        platform=row.platform,
        target=row.target,
        status=row.status,
        reason=row.reason,
        started_at=row.started_at,
        finished_at=row.finished_at,
        steps=tuple(
            rec.RolloutStepInfo(s.step_index, s.canary_weight, s.stable_weight, s.decision, s.reason) for s in row.steps
        ),
    )


def _move(move: AliasChange, direction: str) -> rec.AliasMove:
    return rec.AliasMove(
        alias=move.alias,
        direction="to" if direction == "to" else "from",
        registry_version=move.registry_version,
        model_version=move.model_version,
        previous_model_version=move.previous_model_version,
        actor=move.actor,
        reason=move.reason,
        at=move.created_at,
    )
