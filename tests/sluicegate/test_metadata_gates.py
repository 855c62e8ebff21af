"""Gate results in the metadata store, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sluicegate.metadata import GateResult, MetadataStore
from sluicegate.metadata.gates import gate_results_for_run, recent_gate_results, record_gate_result
from tests.fixtures.metadata import count, start_run


def test_record_gate_result_upserts_per_gate(store: MetadataStore) -> None:
    run = start_run(store)
    with store.session() as session:
        record_gate_result(session, pipeline_run_id=run.id, gate="data-gate", passed=False, metrics={"rows": 3})
        record_gate_result(session, pipeline_run_id=run.id, gate="train-gate", passed=True, metrics={})
    with store.session() as session:
        record_gate_result(
            session,
            pipeline_run_id=run.id,
            gate="data-gate",
            passed=True,
            metrics={"rows": 1000, "checks": [{"name": "nulls", "observed": 0.0, "passed": True}]},
            report_uri="s3://sluicegate/reports/data-gate.html",
        )
    assert count(store, GateResult) == 2
    with store.session() as session:
        results = gate_results_for_run(session, run.id)
        assert [(r.gate, r.passed) for r in results] == [("data-gate", True), ("train-gate", True)]
        assert results[0].metrics["checks"][0] == {"name": "nulls", "observed": 0.0, "passed": True}
        assert results[0].report_uri == "s3://sluicegate/reports/data-gate.html"
        with pytest.raises(LookupError, match="pipeline run 999 does not exist"):
            record_gate_result(session, pipeline_run_id=999, gate="g", passed=True, metrics={})


def test_non_finite_metrics_are_stored_the_same_on_both_backends(store: MetadataStore) -> None:
    run = start_run(store)
    metrics = {"loss": math.nan, "grad_norm": math.inf, "history": [1.5, -math.inf]}
    with store.session() as session:
        record_gate_result(session, pipeline_run_id=run.id, gate="train-gate", passed=False, metrics=metrics)
    with store.session() as session:
        (result,) = gate_results_for_run(session, run.id)
    assert result.metrics == {"loss": "NaN", "grad_norm": "Infinity", "history": [1.5, "-Infinity"]}


def test_recent_gate_results_are_one_gates_history_newest_first(store: MetadataStore) -> None:
    runs = [start_run(store, f"fr-{i}").id for i in range(3)]
    with store.session() as session:
        for run_id, passed in zip(runs, (True, False, True), strict=True):
            record_gate_result(session, pipeline_run_id=run_id, gate="train", passed=passed, metrics={"run": run_id})
        record_gate_result(session, pipeline_run_id=runs[0], gate="data", passed=True, metrics={})
    with store.session() as session:

        def history(**kwargs: Any) -> list[int]:
            return [r.pipeline_run_id for r in recent_gate_results(session, "train", **kwargs)]

        assert history() == [runs[2], runs[0]]  # a failed result is no reference
        assert history(passed_only=False) == [runs[2], runs[1], runs[0]]
        assert history(exclude_run_id=runs[2]) == [runs[0]]
        assert history(limit=1) == [runs[2]]
        assert recent_gate_results(session, "eval") == []
