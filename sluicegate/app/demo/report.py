"""What the demo records of each dataset version it pushes, for its progress lines and closing summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sluicegate.app.demo.prefect_runs import FlowRun
from sluicegate.app.demo.traffic import TrafficReport
from sluicegate.app.demo.watch import Followed


@dataclass(frozen=True)
class Step:
    """One dataset version of the demo."""

    label: str
    count: int  # images of the PCB sample (the digits are all 1,797 scans)
    seed: int
    corrupt: bool = False
    expect: str = "COMPLETED"
    dataset: str = "pcb"
    kind: Literal["pcb", "digits"] = "pcb"


@dataclass
class Outcome:
    step: Step
    data7: str
    pushed_at: float
    followed: Followed
    finished_at: float
    champion_after: str = ""
    traffic: TrafficReport | None = None

    @property
    def flow_run(self) -> FlowRun | None:
        return self.followed.flow_run

    def stage_seconds(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for task in self.followed.tasks:
            totals[task.name] = totals.get(task.name, 0.0) + task.seconds
        return totals


@dataclass
class DemoReport:
    outcomes: list[Outcome] = field(default_factory=list)
    prefect_ui: str = ""
    mlflow_ui: str = ""
    ok: bool = False

    def seconds_to_champion(self, index: int) -> float | None:
        """Manifest PUT -> the run that made this version champion ended (event-to-promotion)."""
        if index >= len(self.outcomes):
            return None
        outcome = self.outcomes[index]
        return outcome.finished_at - outcome.pushed_at if outcome.champion_after else None
