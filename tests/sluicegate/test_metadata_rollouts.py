"""Deployments and rollout steps in the metadata store, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from sluicegate.metadata import Deployment, MetadataStore, RolloutStep
from sluicegate.metadata.rollouts import (
    begin_deployment,
    create_deployment,
    deployments_for_model_version,
    end_deployment,
    finish_deployment,
    latest_deployment,
    record_rollout_step,
    record_step,
    rollout_steps_for_run,
)
from tests.fixtures.metadata import count, model_version, start_run


def test_deployment_and_rollout_steps(store: MetadataStore) -> None:
    version = model_version(store)
    with store.session() as session:
        deployment = create_deployment(
            session, model_version_id=version.id, platform="kubernetes", target="serving/pcb"
        )
        assert deployment.status == "in_progress"
        for index, canary in enumerate((5, 20)):
            record_rollout_step(
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
        record_rollout_step(
            session,
            deployment_id=deployment.id,
            step_index=1,
            canary_weight=20,
            stable_weight=80,
            observed={"error_rate": 0.2},
            decision="fail",
            reason="error rate 0.2 > 0.01",
        )
        done = finish_deployment(session, deployment.id, status="rolled_back", reason="step 1 failed")
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
            create_deployment(session, model_version_id=version.id, platform="ecs", target="t")
        with pytest.raises(LookupError, match="model version 999 does not exist"):
            create_deployment(session, model_version_id=999, platform="local", target="t")
        deployment = create_deployment(session, model_version_id=version.id, platform="local", target="t")
        with pytest.raises(
            ValueError, match=r"status must be one of 'promoted', 'rolled_back', 'failed', got 'in_progress'"
        ):
            finish_deployment(session, deployment.id, status="in_progress")
        step: dict[str, Any] = {"deployment_id": deployment.id, "step_index": 0, "observed": {}, "stable_weight": 95}
        with pytest.raises(ValueError, match=r"decision must be one of 'pass', 'fail', 'inconclusive', got 'maybe'"):
            record_rollout_step(session, canary_weight=5, decision="maybe", **step)
        with pytest.raises(ValueError, match="canary_weight must be a percentage between 0 and 100, got 105"):
            record_rollout_step(session, canary_weight=105, decision="pass", **step)


def test_rollouts_read_back_per_model_version_model_and_run(store: MetadataStore) -> None:
    run = start_run(store)
    first = model_version(store, version="v1", pipeline_run_id=run.id)
    second = model_version(store, version="v2")
    step: dict[str, Any] = {"observed": {}, "decision": "pass"}
    with store.session() as session:
        assert latest_deployment(session, "pcb-defects") is None
        a = create_deployment(session, model_version_id=first.id, platform="local", target="t")
        record_rollout_step(session, deployment_id=a.id, step_index=1, canary_weight=50, stable_weight=50, **step)
        record_rollout_step(session, deployment_id=a.id, step_index=0, canary_weight=10, stable_weight=90, **step)
        b = create_deployment(session, model_version_id=first.id, platform="local", target="t")
        record_rollout_step(session, deployment_id=b.id, step_index=0, canary_weight=10, stable_weight=90, **step)
        c = create_deployment(session, model_version_id=second.id, platform="local", target="t")
    with store.session() as session:
        assert [d.id for d in deployments_for_model_version(session, first.id)] == [a.id, b.id]
        latest = latest_deployment(session, "pcb-defects")
        assert latest is not None and latest.id == c.id and latest.model_version.version == "v2"
        assert latest_deployment(session, "wafers") is None
        steps = [(s.deployment_id, s.step_index) for s in rollout_steps_for_run(session, run.id)]
        assert steps == [(a.id, 0), (a.id, 1), (b.id, 0)]
        assert rollout_steps_for_run(session, run.id + 1) == []


def test_a_rollouts_bookkeeping_on_a_store(store: MetadataStore) -> None:
    row = model_version(store)
    where = {"model_name": row.model_name, "platform": "local", "target": "local:8081"}
    assert begin_deployment(store, model_version="v9.9.9-fffffff-fffffff", **where) is None
    deployment_id = begin_deployment(store, model_version=row.version, **where)
    assert deployment_id is not None
    weights = {"step_index": 0, "canary_weight": 50, "stable_weight": 50}
    record_step(
        store, deployment_id, **weights, observed={"canary": {"requests": 3}}, decision="inconclusive", reason=None
    )
    record_step(store, deployment_id, **weights, observed={"canary": {"requests": 9}}, decision="pass", reason="ok")
    end_deployment(store, deployment_id, "promoted", "every step passed")
    with store.session() as session:
        (deployment,) = deployments_for_model_version(session, row.id)
        assert (deployment.id, deployment.status, deployment.reason) == (deployment_id, "promoted", "every step passed")
        assert deployment.target == "local:8081" and deployment.finished_at is not None
        assert [(s.step_index, s.decision, s.reason, s.observed) for s in deployment.steps] == [
            (0, "pass", "ok", {"canary": {"requests": 9}})  # the step's last read replaced the first
        ]
    with pytest.raises(ValueError, match=r"platform must be one of 'kubernetes', 'local', got 'ecs'"):
        begin_deployment(store, model_version=row.version, **{**where, "platform": "ecs"})
    with pytest.raises(ValueError, match=r"status must be one of 'promoted', 'rolled_back', 'failed'"):
        end_deployment(store, deployment_id, "done", None)
    assert count(store, Deployment) == 1
