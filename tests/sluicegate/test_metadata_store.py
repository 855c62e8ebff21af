"""The metadata store and its repository functions, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import hashlib
import math
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from sluicegate.errors import SchemaOutdated, StoreUnavailable
from sluicegate.metadata import (
    Dataset,
    DatasetVersion,
    GateResult,
    MetadataStore,
    ModelVersion,
    PipelineRun,
    RolloutStep,
    S3Event,
)
from sluicegate.metadata import repository as repo
from tests.fixtures.postgres import free_port

COMMIT = "a" * 40
OBJECTS: dict[str, dict[str, Any]] = {
    "images/0001.png": {"version_id": "v1", "etag": '"e1"', "size": 1234},
    "images/ünïcode name.png": {"version_id": None, "etag": '"e2"', "size": 5_000_000_000},
}


def sha(text_: str) -> str:
    return hashlib.sha256(text_.encode()).hexdigest()


@pytest.fixture
def store(store_url: str) -> Iterator[MetadataStore]:
    store = MetadataStore(store_url)
    store.upgrade()
    yield store
    store.dispose()


def count(store: MetadataStore, model: type[Any]) -> int:
    with store.session() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def add_version(store: MetadataStore, data_version: str, dataset: str = "pcb") -> DatasetVersion:
    with store.session() as session:
        return repo.upsert_dataset_version(
            session,
            dataset_name=dataset,
            data_version=data_version,
            bucket="sluicegate",
            prefix=f"datasets/{dataset}/2026-11-29/",
            manifest_key=f"datasets/{dataset}/2026-11-29/manifest.csv",
            manifest_etag='"m1"',
            manifest_version_id="mv1",
            objects=OBJECTS,
        )


def start_run(store: MetadataStore, flow_run_id: str | None = "fr-1") -> PipelineRun:
    with store.session() as session:
        return repo.start_pipeline_run(
            session,
            prefect_flow_run_id=flow_run_id,
            trigger="event",
            trigger_event_id=str(uuid.uuid4()),
            code_version=COMMIT,
            code_dirty=False,
            parameters={"bucket": "sluicegate", "key": "datasets/pcb/manifest.csv", "epochs": 2},
        )


def claim(store: MetadataStore, dedupe_key: str, **overrides: Any) -> tuple[S3Event, bool]:
    fields: dict[str, Any] = {
        "dedupe_key": dedupe_key,
        "event_id": str(uuid.uuid4()),
        "source": "sqs",
        "bucket": "sluicegate",
        "key": "datasets/pcb/2026-11-29/manifest.csv",
        "etag": '"m1"',
        "version_id": None,
        "sequencer": None,
        "size": 42,
        "event_time": datetime(2026, 11, 29, 12, 0, tzinfo=UTC),
    }
    fields.update(overrides)
    with store.session() as session:
        return repo.claim_s3_event(session, **fields)


# --- datasets -------------------------------------------------------------------------------------------


def test_get_or_create_dataset_is_idempotent(store: MetadataStore) -> None:
    with store.session() as session:
        first = repo.get_or_create_dataset(session, "pcb")
    with store.session() as session:
        second = repo.get_or_create_dataset(session, "pcb")
    assert first.id == second.id
    assert count(store, Dataset) == 1
    assert first.created_at.tzinfo is not None


def test_upsert_dataset_version_round_trips_and_is_idempotent(store: MetadataStore) -> None:
    version = sha("manifest one")
    first = add_version(store, version)
    with store.session() as session:
        second = repo.upsert_dataset_version(
            session,
            dataset_name="pcb",
            data_version=version,
            bucket="other-bucket",
            prefix="elsewhere/",
            manifest_key="elsewhere/manifest.csv",
            manifest_etag='"other"',
            manifest_version_id=None,
            objects={},
        )
    assert second.id == first.id
    assert second.bucket == "sluicegate"  # the existing row comes back unchanged
    assert count(store, DatasetVersion) == 1
    with store.session() as session:
        loaded = session.get(DatasetVersion, first.id)
        assert loaded is not None
        assert loaded.objects == OBJECTS  # nested JSON, unicode keys, None, a size past 2**32
        assert loaded.num_objects == 2
        assert loaded.dataset.name == "pcb"
        assert loaded.created_at.tzinfo == UTC


def test_same_data_version_in_two_datasets_is_two_rows(store: MetadataStore) -> None:
    version = sha("shared manifest")
    assert add_version(store, version, "pcb").id != add_version(store, version, "wafers").id


def test_upsert_dataset_version_rejects_a_malformed_data_version(store: MetadataStore) -> None:
    with store.session() as session, pytest.raises(ValueError, match="data_version must be 64 lowercase hex"):
        repo.upsert_dataset_version(
            session,
            dataset_name="pcb",
            data_version="ABC",
            bucket="b",
            prefix="p/",
            manifest_key="p/manifest.csv",
            manifest_etag='"e"',
            manifest_version_id=None,
            objects={},
        )


def test_find_dataset_version_by_full_hash_and_prefix(store: MetadataStore) -> None:
    version = sha("manifest one")
    row = add_version(store, version)
    with store.session() as session:
        assert_found = [
            repo.find_dataset_version(session, version),
            repo.find_dataset_version(session, version[:7]),
            repo.find_dataset_version(session, version[:12].upper()),
        ]
        assert [found.id if found else None for found in assert_found] == [row.id] * 3
        assert repo.find_dataset_version(session, "0" * 64) is None
        assert repo.find_dataset_version(session, "fffffff") is None


def test_find_dataset_version_rejects_short_or_non_hex_input(store: MetadataStore) -> None:
    with store.session() as session:
        with pytest.raises(ValueError, match="7 to 64 hex characters"):
            repo.find_dataset_version(session, "abc12")
        with pytest.raises(ValueError, match="7 to 64 hex characters"):
            repo.find_dataset_version(session, "v1.0.0-abc1234")


def test_find_dataset_version_reports_an_ambiguous_prefix(store: MetadataStore) -> None:
    first = "abcdef1" + "0" * 57
    second = "abcdef1" + "1" * 57
    add_version(store, first)
    add_version(store, second)
    with store.session() as session:
        with pytest.raises(LookupError, match=r"'abcdef1' is ambiguous: it matches pcb@abcdef100000, pcb@abcdef1111"):
            repo.find_dataset_version(session, "abcdef1")
        found = repo.find_dataset_version(session, "abcdef11")
        assert found is not None and found.data_version == second


def test_latest_dataset_version(store: MetadataStore) -> None:
    with store.session() as session:
        assert repo.latest_dataset_version(session) is None
    add_version(store, sha("one"), "pcb")
    newest_pcb = add_version(store, sha("two"), "pcb")
    newest = add_version(store, sha("three"), "wafers")
    with store.session() as session:
        latest = repo.latest_dataset_version(session)
        latest_pcb = repo.latest_dataset_version(session, "pcb")
        assert repo.latest_dataset_version(session, "missing") is None
    assert latest is not None and latest.id == newest.id
    assert latest_pcb is not None and latest_pcb.id == newest_pcb.id


# --- S3 events ------------------------------------------------------------------------------------------


def test_claim_s3_event_only_once(store: MetadataStore) -> None:
    first, created = claim(store, "sluicegate/key/etag")
    again, created_again = claim(store, "sluicegate/key/etag", source="webhook")
    assert (created, created_again) == (True, False)
    assert again.id == first.id
    assert again.source == "sqs"  # the first claim's row, not the second's values
    assert again.event_id == first.event_id
    assert again.event_time == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert count(store, S3Event) == 1


def test_claim_s3_event_under_concurrency_creates_one_row(store: MetadataStore) -> None:
    results: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def worker() -> None:
        try:
            barrier.wait()
            results.append(claim(store, "contended")[1])
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == [False] * 5 + [True]
    assert count(store, S3Event) == 1


def test_claim_s3_event_validates_its_fields(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match=r"source must be one of 'sqs', 'webhook', got 'kafka'"):
        claim(store, "k1", source="kafka")
    with pytest.raises(ValueError, match="event_id must be a UUID"):
        claim(store, "k2", event_id="not-a-uuid")
    with pytest.raises(ValueError, match="event_time must be timezone-aware"):
        claim(store, "k3", event_time=datetime(2026, 11, 29, 12, 0))
    assert count(store, S3Event) == 0


def test_event_times_come_back_in_utc(store: MetadataStore) -> None:
    plus_two = timezone(timedelta(hours=2))
    row, _ = claim(store, "tz", event_time=datetime(2026, 11, 29, 14, 0, tzinfo=plus_two))
    with store.session() as session:
        loaded = session.get(S3Event, row.id)
        assert loaded is not None and loaded.event_time is not None
        assert loaded.event_time.utcoffset() == timedelta(0)
        assert loaded.event_time == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_mark_s3_event_emitted(store: MetadataStore) -> None:
    claim(store, "emit-me")
    when = datetime(2026, 11, 29, 12, 0, 1, 500, tzinfo=UTC)
    with store.session() as session:
        repo.mark_s3_event_emitted(session, "emit-me", when)
    with store.session() as session:
        row = session.scalars(select(S3Event).where(S3Event.dedupe_key == "emit-me")).one()
        assert row.emitted_at == when
        with pytest.raises(LookupError, match="no S3 event claimed under dedupe key 'missing'"):
            repo.mark_s3_event_emitted(session, "missing", when)


def test_record_dead_letter(store: MetadataStore) -> None:
    with store.session() as session:
        row = repo.record_dead_letter(session, source="sqs", body="{not json", error="Expecting property name")
    assert row.id is not None
    assert row.received_at.tzinfo is not None


# --- pipeline runs and gates ----------------------------------------------------------------------------


def test_start_pipeline_run_is_idempotent_on_the_flow_run_id(store: MetadataStore) -> None:
    run = start_run(store, "fr-1")
    with store.session() as session:
        repo.finish_pipeline_run(session, run.id, status="failed", reason="worker crashed")
    retried = start_run(store, "fr-1")
    assert retried.id == run.id
    assert (retried.status, retried.reason, retried.finished_at) == ("running", None, None)
    assert retried.parameters == {"bucket": "sluicegate", "key": "datasets/pcb/manifest.csv", "epochs": 2}
    assert count(store, PipelineRun) == 1


def test_runs_outside_prefect_are_each_new(store: MetadataStore) -> None:
    assert start_run(store, None).id != start_run(store, None).id
    assert count(store, PipelineRun) == 2


def test_pipeline_run_links_and_finish(store: MetadataStore) -> None:
    version = add_version(store, sha("one"))
    run = start_run(store)
    with store.session() as session:
        repo.set_pipeline_run_dataset(session, run.id, version.id)
        repo.set_pipeline_run_mlflow(session, run.id, "mlflow-run-1")
        finished = repo.finish_pipeline_run(session, run.id, status="succeeded")
    assert finished.finished_at is not None and finished.finished_at >= finished.started_at
    with store.session() as session:
        runs = repo.pipeline_runs_for_dataset_version(session, version.id)
        assert [(r.id, r.mlflow_run_id, r.status) for r in runs] == [(run.id, "mlflow-run-1", "succeeded")]
        assert repo.pipeline_runs_for_dataset_version(session, version.id + 1000) == []
        with pytest.raises(LookupError, match="dataset version 999 does not exist"):
            repo.set_pipeline_run_dataset(session, run.id, 999)
        with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
            repo.set_pipeline_run_mlflow(session, 999, "x")


def test_pipeline_run_validation_messages(store: MetadataStore) -> None:
    with store.session() as session:
        with pytest.raises(ValueError, match=r"trigger must be one of 'event', 'schedule', 'manual', got 'cron'"):
            repo.start_pipeline_run(
                session,
                prefect_flow_run_id="x",
                trigger="cron",
                trigger_event_id=None,
                code_version=COMMIT,
                code_dirty=False,
                parameters={},
            )
        with pytest.raises(ValueError, match="code_version must be a 40-hex git commit or 'unknown'"):
            repo.start_pipeline_run(
                session,
                prefect_flow_run_id="x",
                trigger="manual",
                trigger_event_id=None,
                code_version="abc1234",
                code_dirty=True,
                parameters={},
            )
    run = start_run(store)
    message = r"status must be one of 'succeeded', 'failed', 'skipped', got 'running'"
    with store.session() as session, pytest.raises(ValueError, match=message):
        repo.finish_pipeline_run(session, run.id, status="running")


def test_unknown_code_version_is_accepted(store: MetadataStore) -> None:
    with store.session() as session:
        run = repo.start_pipeline_run(
            session,
            prefect_flow_run_id=None,
            trigger="manual",
            trigger_event_id=None,
            code_version="unknown",
            code_dirty=False,
            parameters={},
        )
    assert run.code_version == "unknown"


def test_record_gate_result_upserts_per_gate(store: MetadataStore) -> None:
    run = start_run(store)
    with store.session() as session:
        repo.record_gate_result(session, pipeline_run_id=run.id, gate="data-gate", passed=False, metrics={"rows": 3})
        repo.record_gate_result(session, pipeline_run_id=run.id, gate="train-gate", passed=True, metrics={})
    with store.session() as session:
        repo.record_gate_result(
            session,
            pipeline_run_id=run.id,
            gate="data-gate",
            passed=True,
            metrics={"rows": 1000, "checks": [{"name": "nulls", "observed": 0.0, "passed": True}]},
            report_uri="s3://sluicegate/reports/data-gate.html",
        )
    assert count(store, GateResult) == 2
    with store.session() as session:
        results = repo.gate_results_for_run(session, run.id)
        assert [(r.gate, r.passed) for r in results] == [("data-gate", True), ("train-gate", True)]
        assert results[0].metrics["checks"][0] == {"name": "nulls", "observed": 0.0, "passed": True}
        assert results[0].report_uri == "s3://sluicegate/reports/data-gate.html"
        with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
            repo.record_gate_result(session, pipeline_run_id=999, gate="g", passed=True, metrics={})


def test_non_finite_metrics_are_stored_the_same_on_both_backends(store: MetadataStore) -> None:
    run = start_run(store)
    metrics = {"loss": math.nan, "grad_norm": math.inf, "history": [1.5, -math.inf]}
    with store.session() as session:
        repo.record_gate_result(session, pipeline_run_id=run.id, gate="train-gate", passed=False, metrics=metrics)
    with store.session() as session:
        (result,) = repo.gate_results_for_run(session, run.id)
    assert result.metrics == {"loss": "NaN", "grad_norm": "Infinity", "history": [1.5, "-Infinity"]}


# --- model versions and deployments ---------------------------------------------------------------------


def model_version(store: MetadataStore, **overrides: Any) -> ModelVersion:
    fields: dict[str, Any] = {
        "model_name": "pcb-defects",
        "version": "v1.0.0-aaaaaaa-bbbbbbb",
        "mlflow_run_id": "mlflow-run-1",
        "code_version": COMMIT,
        "data_version": "b" * 64,
        "artifacts": {"model.onnx": "c" * 64},
        "environment": {"python": "3.11.7", "torch": "2.13.0", "gpu": None},
    }
    fields.update(overrides)
    with store.session() as session:
        return repo.record_model_version(session, **fields)


def test_record_model_version_is_idempotent_and_last_record_wins(store: MetadataStore) -> None:
    run = start_run(store)
    first = model_version(store, pipeline_run_id=run.id)
    second = model_version(store, pipeline_run_id=run.id, mlflow_model_version="3", artifacts={"model.onnx": "d" * 64})
    assert second.id == first.id
    assert count(store, ModelVersion) == 1
    with store.session() as session:
        loaded = session.get(ModelVersion, first.id)
        assert loaded is not None
        assert (loaded.mlflow_model_version, loaded.artifacts) == ("3", {"model.onnx": "d" * 64})
        assert loaded.environment == {"python": "3.11.7", "torch": "2.13.0", "gpu": None}
        assert loaded.pipeline_run is not None and loaded.pipeline_run.id == run.id


def test_record_model_version_validation(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match="data_version must be 64 lowercase hex"):
        model_version(store, data_version="bbbbbbb")
    with pytest.raises(LookupError, match="pipeline run 42 does not exist"):
        model_version(store, pipeline_run_id=42)
    assert count(store, ModelVersion) == 0


def test_deployment_and_rollout_steps(store: MetadataStore) -> None:
    version = model_version(store)
    with store.session() as session:
        deployment = repo.create_deployment(
            session, model_version_id=version.id, platform="kubernetes", target="serving/pcb"
        )
        assert deployment.status == "in_progress"
        for index, canary in enumerate((5, 20)):
            repo.record_rollout_step(
                session,
                deployment_id=deployment.id,
                step_index=index,
                canary_weight=canary,
                stable_weight=100 - canary,
                observed={"error_rate": 0.0, "p99_ms": 12.5},
                decision="pass",
            )
    with store.session() as session:
        # The retried step 1 replaces the first attempt.
        repo.record_rollout_step(
            session,
            deployment_id=deployment.id,
            step_index=1,
            canary_weight=20,
            stable_weight=80,
            observed={"error_rate": 0.2},
            decision="fail",
            reason="error rate 0.2 > 0.01",
        )
        done = repo.finish_deployment(session, deployment.id, status="rolled_back", reason="step 1 failed")
    assert done.finished_at is not None
    assert count(store, RolloutStep) == 2
    with store.session() as session:
        steps = session.scalars(select(RolloutStep).order_by(RolloutStep.step_index)).all()
        assert [(s.step_index, s.canary_weight, s.decision) for s in steps] == [
            (0, 5, "pass"),
            (1, 20, "fail"),
        ]
        assert steps[1].observed == {"error_rate": 0.2}


def test_deployment_validation_messages(store: MetadataStore) -> None:
    version = model_version(store)
    with store.session() as session:
        with pytest.raises(ValueError, match=r"platform must be one of 'kubernetes', 'local', got 'ecs'"):
            repo.create_deployment(session, model_version_id=version.id, platform="ecs", target="t")
        with pytest.raises(LookupError, match="model version 999 does not exist"):
            repo.create_deployment(session, model_version_id=999, platform="local", target="t")
        deployment = repo.create_deployment(session, model_version_id=version.id, platform="local", target="t")
        with pytest.raises(
            ValueError, match=r"status must be one of 'promoted', 'rolled_back', 'failed', got 'in_progress'"
        ):
            repo.finish_deployment(session, deployment.id, status="in_progress")
        step: dict[str, Any] = {"deployment_id": deployment.id, "step_index": 0, "observed": {}, "stable_weight": 95}
        with pytest.raises(ValueError, match=r"decision must be one of 'pass', 'fail', 'inconclusive', got 'maybe'"):
            repo.record_rollout_step(session, canary_weight=5, decision="maybe", **step)
        with pytest.raises(ValueError, match="canary_weight must be a percentage between 0 and 100, got 105"):
            repo.record_rollout_step(session, canary_weight=105, decision="pass", **step)


# --- the store itself -----------------------------------------------------------------------------------


def test_session_rolls_back_on_error(store: MetadataStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.session() as session:
        repo.get_or_create_dataset(session, "pcb")
        raise RuntimeError("boom")
    assert count(store, Dataset) == 0


def test_foreign_keys_are_enforced_on_both_backends(store: MetadataStore) -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), store.session() as session:
        session.add(GateResult(pipeline_run_id=12345, gate="g", passed=True, metrics={}))


def test_check_schema_on_an_unmigrated_database(store_url: str) -> None:
    store = MetadataStore(store_url)
    try:
        assert store.current_revision() is None
        with pytest.raises(SchemaOutdated, match=r"has no sluicegate schema .*run `sluicegate db upgrade`"):
            store.check_schema()
        # Using the store anyway names the same fix on both backends, not a driver error.
        with pytest.raises(SchemaOutdated, match="sluicegate db upgrade"), store.session() as session:
            repo.get_or_create_dataset(session, "pcb")
        store.upgrade()
        store.check_schema()
    finally:
        store.dispose()


def test_check_schema_on_a_database_newer_than_the_code(store: MetadataStore) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff9999'"))
    with pytest.raises(SchemaOutdated, match=r"is at revision ffff9999, newer than .*upgrade sluicegate"):
        store.check_schema()


def test_check_schema_on_an_older_database(store: MetadataStore) -> None:
    store.downgrade("0001")
    with pytest.raises(SchemaOutdated, match=r"is at revision 0001, expected 0002; run `sluicegate db upgrade`"):
        store.check_schema()


def test_unreachable_postgres_names_the_url_without_the_password() -> None:
    store = MetadataStore(f"postgresql+psycopg://u:secret@127.0.0.1:{free_port()}/x")
    try:
        with pytest.raises(StoreUnavailable) as caught, store.session() as session:
            session.execute(text("SELECT 1"))
        message = str(caught.value)
        assert "secret" not in message
        assert "postgresql+psycopg://u:***@127.0.0.1:" in message
        assert "unreachable" in message and "SLUICEGATE_METADATA__URL" in message
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.check_schema()
        with pytest.raises(StoreUnavailable, match="unreachable"):
            store.upgrade()
    finally:
        store.dispose()
    assert store.url_redacted.endswith("/x") and "secret" not in store.url_redacted


def test_unopenable_sqlite_file_is_unavailable(tmp_path: Path) -> None:
    store = MetadataStore(f"sqlite:///{tmp_path}")  # a directory, not a file
    try:
        with pytest.raises(StoreUnavailable, match=f"metadata store at sqlite:///{tmp_path} is unreachable"):
            store.current_revision()
    finally:
        store.dispose()


def test_sqlite_parent_directory_is_created_and_wal_is_on(tmp_path: Path) -> None:
    store = MetadataStore(f"sqlite:///{tmp_path / 'state' / 'nested' / 'metadata.db'}")
    try:
        assert (tmp_path / "state" / "nested").is_dir()
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        store.dispose()
