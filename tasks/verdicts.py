"""What a gate returns: a verdict made of checks. Gates never raise because data or a model is not
good enough; the flow turns a failed verdict into a failed run, a report and a recorded row."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Check:
    """One expectation: what was observed against what was required.

    ``threshold`` is human-readable ("<= 0.05", ">= 0.999", "== 0"); ``detail`` says what failed
    (e.g. the first offending rows) when there is more to say than the number.
    """

    name: str
    observed: Any
    threshold: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class GateVerdict:
    gate: str
    checks: tuple[Check, ...]
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(check for check in self.checks if not check.passed)

    def reason(self) -> str:
        """One line naming each failed check and its observed value."""
        if self.passed:
            return f"{self.gate} gate passed"
        parts = [f"{check.name} observed {_fmt(check.observed)} (required {check.threshold})" for check in self.failed]
        return f"{self.gate} gate failed: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gate": self.gate,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
            "metrics": self.metrics,
        }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
