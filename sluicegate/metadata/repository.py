"""Repository functions over a session from ``MetadataStore.session()``: the only code that writes rows.

Every write a flow can repeat is idempotent on its natural key, so a crashed flow run that is retried
finds its earlier rows instead of adding duplicates. The caller's session commits or rolls back.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from sluicegate.errors import ConfigError
from sluicegate.metadata.models import (
    DECISIONS,
    DEPLOYMENT_STATUSES,
    EVENT_SOURCES,
    PLATFORMS,
    RUN_STATUSES,
    TRIGGERS,
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
    utcnow,
)

_ModelT = TypeVar("_ModelT", bound=Base)

_HEX = re.compile(r"[0-9a-f]+")
MIN_PREFIX = 7
_FINISHED_RUN = tuple(s for s in RUN_STATUSES if s != "running")
_FINISHED_DEPLOYMENT = tuple(s for s in DEPLOYMENT_STATUSES if s != "in_progress")


# --- datasets ------------------------------------------------------------------------------------------


def get_or_create_dataset(session: Session, name: str) -> Dataset:
    """Return the dataset called ``name``, creating it if absent.

    Args:
        session: An open session.
        name: The dataset's name (the folder under the datasets prefix, e.g. ``pcb``).

    Returns:
        The one row for ``name``; two processes creating it at once still end with one row.

    Raises:
        ValueError: ``name`` is empty.
    """
    if not name.strip():
        raise ValueError("dataset name must not be empty")
    found = session.scalars(select(Dataset).where(Dataset.name == name)).one_or_none()
    if found is not None:
        return found
    _insert_ignore(session, Dataset, {"name": name, "created_at": utcnow()}, ("name",))
    return session.scalars(select(Dataset).where(Dataset.name == name)).one()


def upsert_dataset_version(
    session: Session,
    *,
    dataset_name: str,
    data_version: str,
    bucket: str,
    prefix: str,
    manifest_key: str,
    manifest_etag: str,
    manifest_version_id: str | None,
    objects: Mapping[str, Mapping[str, Any]],
) -> DatasetVersion:
    """Record a dataset version, or return the one already recorded for it.

    Args:
        session: An open session.
        dataset_name: The dataset it belongs to (created if new).
        data_version: sha256 of the manifest bytes, 64 lowercase hex characters.
        bucket: Bucket holding the objects.
        prefix: Key prefix of the version's folder.
        manifest_key: Key of the manifest.
        manifest_etag: ETag of the manifest object.
        manifest_version_id: S3 version id of the manifest; None on an unversioned bucket.
        objects: Relative path -> ``{"version_id", "etag", "size"}`` of every object the manifest lists.

    Returns:
        The row for (dataset, data_version). When it exists already it is returned unchanged: the data
        version is a content hash, so the first record of it stands.

    Raises:
        ValueError: ``data_version`` is not a sha256 hex digest.
    """
    _check_hex("data_version", data_version, 64)
    dataset = get_or_create_dataset(session, dataset_name)
    key = (DatasetVersion.dataset_id == dataset.id, DatasetVersion.data_version == data_version)
    found = session.scalars(select(DatasetVersion).where(*key)).one_or_none()
    if found is not None:
        return found
    values = {
        "dataset_id": dataset.id,
        "data_version": data_version,
        "bucket": bucket,
        "prefix": prefix,
        "manifest_key": manifest_key,
        "manifest_etag": manifest_etag,
        "manifest_version_id": manifest_version_id,
        "objects": {path: dict(meta) for path, meta in objects.items()},
        "num_objects": len(objects),
        "created_at": utcnow(),
    }
    _insert_ignore(session, DatasetVersion, values, ("dataset_id", "data_version"))
    return session.scalars(select(DatasetVersion).where(*key)).one()


def find_dataset_version(session: Session, data_version_or_prefix: str) -> DatasetVersion | None:
    """Find a dataset version by its full data version or a unique prefix of it.

    Args:
        session: An open session.
        data_version_or_prefix: 7 to 64 hex characters (case-insensitive), e.g. the ``data7`` part of a
            model version.

    Returns:
        The matching row, or None when nothing matches.

    Raises:
        ValueError: the argument is not hex or shorter than 7 characters.
        LookupError: more than one dataset version matches; the message lists them.
    """
    text = data_version_or_prefix.strip().lower()
    if len(text) < MIN_PREFIX or len(text) > 64 or not _HEX.fullmatch(text):
        raise ValueError(
            f"data version {data_version_or_prefix!r} must be {MIN_PREFIX} to 64 hex characters "
            "(a sha256 of the manifest or a prefix of it)"
        )
    column = DatasetVersion.data_version
    # Validated as hex above, so the prefix holds no LIKE wildcards.
    condition = column == text if len(text) == 64 else column.startswith(text)
    rows = session.scalars(select(DatasetVersion).where(condition).order_by(DatasetVersion.id).limit(6)).all()
    if len(rows) <= 1:
        return rows[0] if rows else None
    shown = ", ".join(f"{row.dataset.name}@{row.data_version[:12]}" for row in rows[:5])
    more = " and more" if len(rows) > 5 else ""
    raise LookupError(f"data version {text!r} is ambiguous: it matches {shown}{more}; give more hex characters")


def latest_dataset_version(session: Session, dataset_name: str | None = None) -> DatasetVersion | None:
    """The most recently recorded dataset version.

    Args:
        session: An open session.
        dataset_name: Only versions of this dataset; None: of any dataset.

    Returns:
        The newest row by record time, or None when there is none.
    """
    query = select(DatasetVersion).order_by(DatasetVersion.created_at.desc(), DatasetVersion.id.desc())
    if dataset_name is not None:
        query = query.join(Dataset).where(Dataset.name == dataset_name)
    return session.scalars(query.limit(1)).first()


# --- S3 events ------------------------------------------------------------------------------------------


def claim_s3_event(
    session: Session,
    *,
    dedupe_key: str,
    event_id: str,
    source: str,
    bucket: str,
    key: str,
    etag: str,
    version_id: str | None,
    sequencer: str | None,
    size: int | None,
    event_time: datetime | None,
) -> tuple[S3Event, bool]:
    """Record an incoming S3 event unless one with the same ``dedupe_key`` was recorded before.

    Safe with several bridge workers: the insert is ``ON CONFLICT DO NOTHING``, so exactly one claimant
    sees ``created=True`` and emits the Prefect event.

    Args:
        session: An open session.
        dedupe_key: Identity of the object write (bucket, key, ETag, and version id/sequencer when sent).
        event_id: The Prefect event id (a UUID) the bridge will emit for it.
        source: ``"sqs"`` or ``"webhook"``.
        bucket: Bucket of the object.
        key: Decoded object key.
        etag: ETag of the object.
        version_id: S3 version id; None when the notification has none.
        sequencer: S3 sequencer; None when the notification has none.
        size: Object size in bytes, if sent.
        event_time: When S3 saw the write (timezone-aware), if sent.

    Returns:
        ``(row, created)``: the recorded event (possibly an earlier claim's), and whether this call
        inserted it.

    Raises:
        ValueError: ``source`` is unknown, ``event_id`` is not a UUID, or ``event_time`` is naive.
    """
    _check_choice("source", source, EVENT_SOURCES)
    _check_aware("event_time", event_time)
    try:
        event_uuid = str(uuid.UUID(event_id))
    except ValueError:
        raise ValueError(f"event_id must be a UUID (the Prefect event id), got {event_id!r}") from None
    values = {
        "dedupe_key": dedupe_key,
        "event_id": event_uuid,
        "source": source,
        "bucket": bucket,
        "key": key,
        "etag": etag,
        "version_id": version_id,
        "sequencer": sequencer,
        "size": size,
        "event_time": event_time,
        "received_at": utcnow(),
    }
    created = _insert_ignore(session, S3Event, values, ("dedupe_key",))
    row = session.scalars(select(S3Event).where(S3Event.dedupe_key == dedupe_key)).one()
    return row, created


def mark_s3_event_emitted(session: Session, dedupe_key: str, when: datetime) -> None:
    """Note that the Prefect event for a claimed S3 event was emitted.

    Args:
        session: An open session.
        dedupe_key: The key the event was claimed under.
        when: Emission time (timezone-aware); a repeated call overwrites it.

    Raises:
        LookupError: no event was claimed under ``dedupe_key``.
        ValueError: ``when`` is naive.
    """
    _check_aware("when", when)
    row = session.scalars(select(S3Event).where(S3Event.dedupe_key == dedupe_key)).one_or_none()
    if row is None:
        raise LookupError(f"no S3 event claimed under dedupe key {dedupe_key!r}; claim it first")
    row.emitted_at = when


def record_dead_letter(session: Session, *, source: str, body: str, error: str) -> DeadLetter:
    """Keep a message the bridge could not understand, with the reason.

    Args:
        session: An open session.
        source: Where it came from (``"sqs"``, ``"webhook"``).
        body: The raw message body.
        error: Why it was set aside.

    Returns:
        The new row (every call adds one: the same bad message arriving twice is two deliveries).
    """
    row = DeadLetter(source=source, body=body, error=error, received_at=utcnow())
    session.add(row)
    session.flush()
    return row


# --- pipeline runs and gates ---------------------------------------------------------------------------


def start_pipeline_run(
    session: Session,
    *,
    prefect_flow_run_id: str | None,
    trigger: str,
    trigger_event_id: str | None,
    code_version: str,
    code_dirty: bool,
    parameters: Mapping[str, Any],
) -> PipelineRun:
    """Record the start of a pipeline run, or the restart of a retried one.

    Args:
        session: An open session.
        prefect_flow_run_id: The Prefect flow run id; None for a run outside Prefect (always a new row).
        trigger: ``"event"``, ``"schedule"`` or ``"manual"``.
        trigger_event_id: Id of the Prefect event that triggered it, if any.
        code_version: The git commit (40 hex characters) or ``"unknown"``.
        code_dirty: Whether the working tree had uncommitted changes.
        parameters: The flow parameters (JSON-serialisable).

    Returns:
        The run's row. For a flow run id seen before, the earlier row with status ``"running"`` again
        and its reason and finish time cleared.

    Raises:
        ValueError: ``trigger`` or ``code_version`` is invalid.
    """
    _check_choice("trigger", trigger, TRIGGERS)
    _check_code_version(code_version)
    if prefect_flow_run_id is not None:
        found = session.scalars(
            select(PipelineRun).where(PipelineRun.prefect_flow_run_id == prefect_flow_run_id)
        ).one_or_none()
        if found is not None:
            found.status, found.reason, found.finished_at = "running", None, None
            return found
    run = PipelineRun(
        prefect_flow_run_id=prefect_flow_run_id,
        trigger=trigger,
        trigger_event_id=trigger_event_id,
        code_version=code_version,
        code_dirty=code_dirty,
        parameters=dict(parameters),
        status="running",
        started_at=utcnow(),
    )
    session.add(run)
    session.flush()
    return run


def set_pipeline_run_dataset(session: Session, run_id: int, dataset_version_id: int) -> PipelineRun:
    """Link a run to the dataset version it resolved.

    Args:
        session: An open session.
        run_id: The pipeline run.
        dataset_version_id: The dataset version it trains on.

    Returns:
        The updated run.

    Raises:
        LookupError: the run or the dataset version does not exist.
    """
    run = _get(session, PipelineRun, run_id, "pipeline run")
    _get(session, DatasetVersion, dataset_version_id, "dataset version")
    run.dataset_version_id = dataset_version_id
    return run


def set_pipeline_run_mlflow(session: Session, run_id: int, mlflow_run_id: str) -> PipelineRun:
    """Link a run to its MLflow run.

    Args:
        session: An open session.
        run_id: The pipeline run.
        mlflow_run_id: The MLflow run id.

    Returns:
        The updated run.

    Raises:
        LookupError: the run does not exist.
    """
    run = _get(session, PipelineRun, run_id, "pipeline run")
    run.mlflow_run_id = mlflow_run_id
    return run


def finish_pipeline_run(session: Session, run_id: int, *, status: str, reason: str | None = None) -> PipelineRun:
    """Record how a run ended.

    Args:
        session: An open session.
        run_id: The pipeline run.
        status: ``"succeeded"``, ``"failed"`` or ``"skipped"``.
        reason: Why it failed or was skipped, for people reading the lineage.

    Returns:
        The updated run, with its finish time set to now.

    Raises:
        ValueError: ``status`` is not a final status.
        LookupError: the run does not exist.
    """
    _check_choice("status", status, _FINISHED_RUN)
    run = _get(session, PipelineRun, run_id, "pipeline run")
    run.status, run.reason, run.finished_at = status, reason, utcnow()
    return run


def record_gate_result(
    session: Session,
    *,
    pipeline_run_id: int,
    gate: str,
    passed: bool,
    metrics: Mapping[str, Any],
    report_uri: str | None = None,
) -> GateResult:
    """Record a gate's verdict for a run; a repeated gate replaces its earlier result.

    Args:
        session: An open session.
        pipeline_run_id: The pipeline run.
        gate: The gate's name (e.g. ``"data-gate"``).
        passed: The verdict.
        metrics: Observed values and thresholds (JSON-serialisable; NaN/inf are stored as strings).
        report_uri: Where the gate's report lives, if it wrote one.

    Returns:
        The one row for (run, gate).

    Raises:
        LookupError: the run does not exist.
    """
    _get(session, PipelineRun, pipeline_run_id, "pipeline run")
    found = session.scalars(
        select(GateResult).where(GateResult.pipeline_run_id == pipeline_run_id, GateResult.gate == gate)
    ).one_or_none()
    if found is None:
        found = GateResult(pipeline_run_id=pipeline_run_id, gate=gate, created_at=utcnow())
        session.add(found)
    found.passed, found.metrics, found.report_uri = passed, dict(metrics), report_uri
    session.flush()
    return found


def pipeline_runs_for_dataset_version(session: Session, dataset_version_id: int) -> list[PipelineRun]:
    """Runs that trained on a dataset version, oldest first.

    Args:
        session: An open session.
        dataset_version_id: The dataset version.

    Returns:
        The runs (empty when none).
    """
    query = (
        select(PipelineRun)
        .where(PipelineRun.dataset_version_id == dataset_version_id)
        .order_by(PipelineRun.started_at, PipelineRun.id)
    )
    return list(session.scalars(query))


def gate_results_for_run(session: Session, run_id: int) -> list[GateResult]:
    """A run's gate results in the order they were first recorded.

    Args:
        session: An open session.
        run_id: The pipeline run.

    Returns:
        The results (empty when none).
    """
    query = select(GateResult).where(GateResult.pipeline_run_id == run_id).order_by(GateResult.id)
    return list(session.scalars(query))


def recent_gate_results(
    session: Session, gate: str, *, passed_only: bool = True, exclude_run_id: int | None = None, limit: int = 50
) -> list[GateResult]:
    """The most recent results of one gate across runs, newest first (a gate's history).

    Args:
        session: An open session.
        gate: Gate name, e.g. "train".
        passed_only: Only results that passed (a failed run is not a reference).
        exclude_run_id: Leave out this run (the one being judged).
        limit: At most this many.

    Returns:
        The results, newest first.
    """
    query = select(GateResult).where(GateResult.gate == gate)
    if passed_only:
        query = query.where(GateResult.passed.is_(True))
    if exclude_run_id is not None:
        query = query.where(GateResult.pipeline_run_id != exclude_run_id)
    return list(session.scalars(query.order_by(GateResult.id.desc()).limit(limit)))


# --- model versions and deployments ---------------------------------------------------------------------


def record_model_version(
    session: Session,
    *,
    model_name: str,
    version: str,
    mlflow_run_id: str,
    code_version: str,
    data_version: str,
    artifacts: Mapping[str, str],
    environment: Mapping[str, Any],
    pipeline_run_id: int | None = None,
    dataset_version_id: int | None = None,
    mlflow_model_version: str | None = None,
) -> ModelVersion:
    """Record a model version; recording the same (model_name, version) again updates that row.

    A retried run rebuilds the same version string (same commit and data) and its last attempt's
    artifacts are the ones registered, so the last record wins rather than the first.

    Args:
        session: An open session.
        model_name: Registered model name.
        version: ``v{MAJOR}.{MINOR}.{PATCH}-{commit7}-{data7}``.
        mlflow_run_id: The MLflow run that produced it.
        code_version: The git commit (40 hex characters) or ``"unknown"``.
        data_version: sha256 of the training dataset's manifest.
        artifacts: File name -> sha256 of each artifact.
        environment: Library, driver and GPU versions it was built with.
        pipeline_run_id: The pipeline run that produced it, if any.
        dataset_version_id: The dataset version it was trained on, if recorded.
        mlflow_model_version: The MLflow registry version, once registered.

    Returns:
        The one row for (model_name, version).

    Raises:
        ValueError: ``code_version`` or ``data_version`` is malformed.
        LookupError: ``pipeline_run_id`` or ``dataset_version_id`` does not exist.
    """
    _check_code_version(code_version)
    _check_hex("data_version", data_version, 64)
    if pipeline_run_id is not None:
        _get(session, PipelineRun, pipeline_run_id, "pipeline run")
    if dataset_version_id is not None:
        _get(session, DatasetVersion, dataset_version_id, "dataset version")
    found = session.scalars(
        select(ModelVersion).where(ModelVersion.model_name == model_name, ModelVersion.version == version)
    ).one_or_none()
    if found is None:
        found = ModelVersion(model_name=model_name, version=version, created_at=utcnow())
        session.add(found)
    found.mlflow_run_id, found.mlflow_model_version = mlflow_run_id, mlflow_model_version
    found.code_version, found.data_version = code_version, data_version
    found.artifacts, found.environment = dict(artifacts), dict(environment)
    found.pipeline_run_id, found.dataset_version_id = pipeline_run_id, dataset_version_id
    session.flush()
    return found


def create_deployment(session: Session, *, model_version_id: int, platform: str, target: str) -> Deployment:
    """Record the start of a rollout of a model version.

    Args:
        session: An open session.
        model_version_id: The model version being rolled out.
        platform: ``"kubernetes"`` or ``"local"``.
        target: What is rolled (e.g. ``namespace/service``).

    Returns:
        A new row, status ``"in_progress"``. Every call is a new rollout attempt: a retried rollout
        should first finish the stale attempt as ``"failed"``.

    Raises:
        ValueError: ``platform`` is unknown.
        LookupError: the model version does not exist.
    """
    _check_choice("platform", platform, PLATFORMS)
    _get(session, ModelVersion, model_version_id, "model version")
    row = Deployment(
        model_version_id=model_version_id,
        platform=platform,
        target=target,
        status="in_progress",
        started_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return row


def finish_deployment(session: Session, deployment_id: int, *, status: str, reason: str | None = None) -> Deployment:
    """Record how a rollout ended.

    Args:
        session: An open session.
        deployment_id: The deployment.
        status: ``"promoted"``, ``"rolled_back"`` or ``"failed"``.
        reason: Why it was rolled back or failed.

    Returns:
        The updated row, with its finish time set to now.

    Raises:
        ValueError: ``status`` is not a final status.
        LookupError: the deployment does not exist.
    """
    _check_choice("status", status, _FINISHED_DEPLOYMENT)
    row = _get(session, Deployment, deployment_id, "deployment")
    row.status, row.reason, row.finished_at = status, reason, utcnow()
    return row


def record_rollout_step(
    session: Session,
    *,
    deployment_id: int,
    step_index: int,
    canary_weight: int,
    stable_weight: int,
    observed: Mapping[str, Any],
    decision: str,
    reason: str | None = None,
) -> RolloutStep:
    """Record one canary step's weights, observations and decision; a repeated step replaces itself.

    Args:
        session: An open session.
        deployment_id: The deployment.
        step_index: 0-based position in the rollout plan.
        canary_weight: Percent of traffic on the candidate (0-100).
        stable_weight: Percent of traffic on the stable model (0-100).
        observed: Metrics observed at this step (JSON-serialisable).
        decision: ``"pass"``, ``"fail"`` or ``"inconclusive"``.
        reason: Why, in words.

    Returns:
        The one row for (deployment, step_index).

    Raises:
        ValueError: ``decision`` is unknown, or a weight or the index is out of range.
        LookupError: the deployment does not exist.
    """
    _check_choice("decision", decision, DECISIONS)
    if step_index < 0:
        raise ValueError(f"step_index must be >= 0, got {step_index}")
    for field, weight in (("canary_weight", canary_weight), ("stable_weight", stable_weight)):
        if not 0 <= weight <= 100:
            raise ValueError(f"{field} must be a percentage between 0 and 100, got {weight}")
    _get(session, Deployment, deployment_id, "deployment")
    found = session.scalars(
        select(RolloutStep).where(RolloutStep.deployment_id == deployment_id, RolloutStep.step_index == step_index)
    ).one_or_none()
    if found is None:
        found = RolloutStep(deployment_id=deployment_id, step_index=step_index, created_at=utcnow())
        session.add(found)
    found.canary_weight, found.stable_weight = canary_weight, stable_weight
    found.observed, found.decision, found.reason = dict(observed), decision, reason
    session.flush()
    return found


# --- helpers --------------------------------------------------------------------------------------------


def _insert_ignore(session: Session, model: type[Base], values: Mapping[str, Any], conflict: tuple[str, ...]) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING; True when this call inserted the row."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        pg = postgresql.insert(model).values(**values).on_conflict_do_nothing(index_elements=conflict)
        stmt = pg.returning(pg.table.c.id)
    elif dialect == "sqlite":
        lite = sqlite.insert(model).values(**values).on_conflict_do_nothing(index_elements=conflict)
        stmt = lite.returning(lite.table.c.id)
    else:
        raise ConfigError(
            f"the metadata store supports postgresql and sqlite, not {dialect}; "
            "set SLUICEGATE_METADATA__URL to a postgresql+psycopg:// or sqlite:/// URL"
        )
    return session.execute(stmt).first() is not None


def _get(session: Session, model: type[_ModelT], row_id: int, what: str) -> _ModelT:
    row = session.get(model, row_id)
    if row is None:
        raise LookupError(f"{what} {row_id} does not exist in the metadata store")
    return row


def _check_choice(field: str, value: str, allowed: Collection[str]) -> None:
    if value not in allowed:
        choices = ", ".join(repr(choice) for choice in allowed)
        raise ValueError(f"{field} must be one of {choices}, got {value!r}")


def _check_hex(field: str, value: str, length: int) -> None:
    if len(value) != length or not _HEX.fullmatch(value):
        raise ValueError(f"{field} must be {length} lowercase hex characters, got {value!r}")


def _check_code_version(value: str) -> None:
    if value != "unknown" and (len(value) != 40 or not _HEX.fullmatch(value)):
        raise ValueError(f"code_version must be a 40-hex git commit or 'unknown', got {value!r}")


def _check_aware(field: str, value: datetime | None) -> None:
    if value is not None and value.tzinfo is None:
        raise ValueError(f"{field} must be timezone-aware (UTC), got naive {value.isoformat()}")
