"""Reading flow runs from a Prefect server over its REST API (no Prefect import: cheap, any process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@dataclass(frozen=True)
class FlowRun:
    id: str
    name: str
    state: str
    parameters: dict[str, Any]
    created: datetime
    start_time: datetime | None
    end_time: datetime | None
    state_message: str | None

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> FlowRun:
        def when(value: str | None) -> datetime | None:
            return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None

        created = when(raw["created"])
        assert created is not None
        return cls(
            id=raw["id"],
            name=raw["name"],
            state=raw.get("state_type") or "UNKNOWN",
            parameters=raw.get("parameters") or {},
            created=created,
            start_time=when(raw.get("start_time")),
            end_time=when(raw.get("end_time")),
            state_message=(raw.get("state") or {}).get("message"),
        )


def flow_runs_for_key(api_url: str, key: str, *, tag: str = "pipeline", limit: int = 200) -> list[FlowRun]:
    """Pipeline flow runs whose ``key`` parameter is the given manifest key, newest first."""
    response = httpx.post(
        f"{api_url.rstrip('/')}/flow_runs/filter",
        json={"flow_runs": {"tags": {"all_": [tag]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": limit},
        timeout=10,
    )
    response.raise_for_status()
    return [FlowRun.from_api(raw) for raw in response.json() if (raw.get("parameters") or {}).get("key") == key]


def wait_for_flow_run(
    api_url: str,
    key: str,
    *,
    timeout: float,
    until: Callable[[FlowRun], bool] = lambda run: run.final,
    on_change: Callable[[FlowRun], None] | None = None,
    poll: float = 0.2,
) -> FlowRun | None:
    """Wait until the flow run for ``key`` satisfies ``until``; None when none did within ``timeout``."""
    deadline = time.monotonic() + timeout
    last: tuple[str, str] | None = None
    while time.monotonic() < deadline:
        runs = flow_runs_for_key(api_url, key)
        if runs:
            run = runs[0]
            if on_change is not None and (run.name, run.state) != last:
                last = (run.name, run.state)
                on_change(run)
            if until(run):
                return run
        time.sleep(poll)
    return None
