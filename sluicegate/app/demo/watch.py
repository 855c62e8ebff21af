"""Following one pipeline flow run for the demo: its task runs as they finish, and the canary's steps.

Read over Prefect's REST API and from the metadata store, like an operator's dashboard would, so the demo
shows what the platform recorded rather than what the demo hoped happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from sluicegate.app.demo.prefect_runs import FlowRun, flow_runs_for_key
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.rollouts import rollout_steps_for_run
from sluicegate.metadata.runs import pipeline_run_for_flow_run


@dataclass(frozen=True)
class TaskRun:
    name: str
    state: str
    seconds: float


@dataclass
class Followed:
    flow_run: FlowRun | None
    tasks: list[TaskRun] = field(default_factory=list)
    steps: list[tuple[int, str, str]] = field(default_factory=list)  # (canary weight, decision, reason)


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def task_runs(api_url: str, flow_run_ids: list[str]) -> list[TaskRun]:
    """Finished task runs of the given flow runs, in the order they ended."""
    response = httpx.post(
        f"{api_url.rstrip('/')}/task_runs/filter",
        json={"task_runs": {"flow_run_id": {"any_": flow_run_ids}}, "sort": "END_TIME_DESC", "limit": 200},
        timeout=10,
    )
    response.raise_for_status()
    done: list[tuple[datetime, TaskRun]] = []
    for raw in response.json():
        start, end = _when(raw.get("start_time")), _when(raw.get("end_time"))
        if end is None or raw.get("state_type") not in ("COMPLETED", "FAILED", "CRASHED"):
            continue
        seconds = (end - start).total_seconds() if start else 0.0
        # "data-gate-3f2" -> "data-gate": Prefect appends a short random suffix to task run names.
        name = raw["name"].rsplit("-", 1)[0] if raw["name"].count("-") else raw["name"]
        done.append((end, TaskRun(name, raw["state_type"], seconds)))
    return [run for _, run in sorted(done, key=lambda pair: pair[0])]


def child_flow_runs(api_url: str, parent_id: str) -> list[str]:
    """Ids of the subflow runs (the canary) started by ``parent_id``."""
    response = httpx.post(
        f"{api_url.rstrip('/')}/flow_runs/filter",
        json={"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}, "limit": 20},
        timeout=10,
    )
    response.raise_for_status()
    return [raw["id"] for raw in response.json()]


def rollout_steps(store: MetadataStore, flow_run_id: str) -> list[tuple[int, str, str]]:
    """The canary steps recorded for the model version this pipeline run produced."""
    with store.session() as session:
        run = pipeline_run_for_flow_run(session, flow_run_id)
        if run is None:
            return []
        return [
            (step.canary_weight, step.decision, step.reason or "") for step in rollout_steps_for_run(session, run.id)
        ]


def follow(
    api_url: str,
    store: MetadataStore,
    key: str,
    *,
    timeout: float,
    on_task: Callable[[TaskRun], None],
    on_step: Callable[[tuple[int, str, str]], None],
    on_state: Callable[[FlowRun], None],
    poll: float = 1.0,
) -> Followed:
    """Follow the pipeline run triggered by the manifest ``key`` until it ends (or ``timeout``)."""
    followed = Followed(None)
    deadline = time.monotonic() + timeout
    last_state: tuple[str, str] | None = None
    while time.monotonic() < deadline:
        runs = flow_runs_for_key(api_url, key)
        if runs:
            run = followed.flow_run = runs[0]
            if (run.name, run.state) != last_state:
                last_state = (run.name, run.state)
                on_state(run)
            _report_new(task_runs(api_url, [run.id, *child_flow_runs(api_url, run.id)]), followed.tasks, on_task)
            _report_changed(rollout_steps(store, run.id), followed.steps, on_step)
            if run.final:
                return followed
        time.sleep(poll)
    return followed


def _report_new(current: list[Any], seen: list[Any], report: Callable[[Any], None]) -> None:
    for item in current[len(seen) :]:
        seen.append(item)
        report(item)


def _report_changed(current: list[Any], seen: list[Any], report: Callable[[Any], None]) -> None:
    """Like ``_report_new``, and also an entry recorded again with another value (a step judged again)."""
    for index, item in enumerate(current):
        if index >= len(seen):
            seen.append(item)
            report(item)
        elif seen[index] != item:
            seen[index] = item
            report(item)
