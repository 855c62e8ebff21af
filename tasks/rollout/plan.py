"""The rollout plan and its analysis: a pure function from observed stable and canary metrics to
pass / fail / inconclusive, with a reason for every check (DESIGN section 5, "canary step").

A step passes when every check passes; fails when any check fails (errors and an entropy collapse
count at once, latency only once ``min_requests`` were served: the p95 of a few requests is their
slowest one); is inconclusive when nothing failed but the canary has not served ``min_requests`` yet
(the flow waits, then fails after ``max_inconclusive`` more intervals: a canary nobody can judge is not
promoted). Checks:

- latency: canary p95 <= stable p95 x (1 + ``max_p95_increase``), and only counted a failure when the
  difference is also above ``min_p95_delta_s``. The floor is there because p95s come from histogram
  buckets (serving/observability/metrics.py): two identical models interpolate inside the same bucket
  and can still differ by more than 10% at sub-millisecond latencies, which no user would notice.
  A canary p95 above the bound fails only when it is also significant: the canary's requests slower
  than the bound are more than 5% of them with a one-sided binomial test at ``latency_alpha`` (scipy).
  Otherwise the check passes, as Kayenta's judge passes a metric without a significant difference.
  The canary has a fraction of stable's requests, so a stall that delays three of its 41 requests
  moves its p95 past any bound (seen twice in CI on 2 cores, 3 of 41 and 3 of 50) while stable's 160
  hardly move. Waiting does not help, because the window is cumulative and the three stay in it. A
  canary that is really slower fails at once: 18 of 41 past the bound is p < 1e-9.
- errors: canary error rate <= stable error rate + ``max_error_rate_increase`` (0.5 points);
- entropy: the canary's output entropy has not collapsed (the server's ``EntropyMonitor`` verdict:
  entropy std <= 0.05 bits without the excuse of a confident, varied classifier) while stable's has not
  either: when both look collapsed on the same traffic, the inputs make the answers alike, not the canary;
- custom: each ``CustomCheck`` (a PromQL query per version, e.g. a business metric) against its bound.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

Decision = Literal["pass", "fail", "inconclusive"]
_OPERATORS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


@dataclass(frozen=True)
class CustomCheck:
    """An operator's own PromQL check, evaluated for the canary version.

    ``query`` may use ``{model}`` and ``{version}`` (filled in per version) and ``{window}`` (the
    analysis window, e.g. ``60s``); the check passes when ``value <op> bound``. With ``relative`` the
    bound is added to the stable version's value of the same query (``canary <= stable + bound``).
    """

    name: str
    query: str
    op: Literal["<=", "<", ">=", ">"] = "<="
    bound: float = 0.0
    relative: bool = False

    def __post_init__(self) -> None:
        if self.op not in _OPERATORS:
            raise ValueError(f"custom check {self.name!r}: op {self.op!r}; expected one of {sorted(_OPERATORS)}")
        if not self.name or not self.query:
            raise ValueError("a custom check needs a name and a query")


@dataclass(frozen=True)
class Thresholds:
    max_p95_increase: float = 0.10
    min_p95_delta_s: float = 0.002
    max_error_rate_increase: float = 0.005
    latency_alpha: float = 0.01


@dataclass(frozen=True)
class RolloutPlan:
    """Steps (percent of traffic on the canary; the last must be 100: promotion), how long each is held,
    how many canary requests a decision needs, and the checks.

    Args:
        steps: Canary weights, increasing, ending at 100.
        hold_s: Seconds each step is held before it is judged (the analysis window).
        analysis_interval_s: Seconds between two reads of the metrics while holding (a failing check
            ends the step early: rollback does not wait for the hold).
        min_requests: Canary requests in the window before a step can pass.
        max_inconclusive: Extra analysis intervals an inconclusive step may wait before it fails.
        pause_before: Steps (weights) at which the rollout pauses until an operator resumes it.
    """

    steps: tuple[int, ...] = (5, 20, 50, 100)
    hold_s: float = 60.0
    analysis_interval_s: float = 10.0
    min_requests: int = 200
    max_inconclusive: int = 3
    thresholds: Thresholds = field(default_factory=Thresholds)
    custom_checks: tuple[CustomCheck, ...] = ()
    pause_before: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        steps = self.steps
        if not steps or steps[-1] != 100:
            raise ValueError(f"plan steps {list(steps)}: the last step must be 100 (promotion)")
        if any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"plan steps {list(steps)}: expected increasing percentages in 1..100")
        if self.hold_s <= 0 or self.analysis_interval_s <= 0:
            raise ValueError("hold_s and analysis_interval_s must be positive")
        if self.min_requests < 1 or self.max_inconclusive < 0:
            raise ValueError("min_requests must be >= 1 and max_inconclusive >= 0")
        unknown = [p for p in self.pause_before if p not in steps]
        if unknown:
            raise ValueError(f"pause_before {unknown} are not steps of the plan {list(steps)}")

    @property
    def analysed_steps(self) -> tuple[int, ...]:
        """The steps that are judged; 100 is the promotion itself (stable then has no traffic to compare)."""
        return tuple(s for s in self.steps if s < 100)


@dataclass(frozen=True)
class VersionMetrics:
    """One version's traffic over the analysis window."""

    requests: float
    errors: float
    p95_s: float | None  # None: no successful request in the window
    entropy_collapsed: bool | None = None  # None: the server exports no verdict (telemetry off)
    custom: Mapping[str, float] = field(default_factory=dict)
    # Cumulative (upper bound, count) latency buckets over the window, the histogram p95_s came from;
    # empty when the source has none, and then a p95 past the bound fails without a significance test.
    latency_buckets: tuple[tuple[float, float], ...] = ()

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 6),
            "p95_s": self.p95_s,
            "entropy_collapsed": self.entropy_collapsed,
            **{f"custom.{k}": v for k, v in self.custom.items()},
        }


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool | None  # None: could not be judged yet
    detail: str


@dataclass(frozen=True)
class Analysis:
    decision: Decision
    checks: tuple[CheckResult, ...]

    @property
    def reasons(self) -> list[str]:
        """The failed (or, when inconclusive, the undecided) checks' details."""
        wanted = False if self.decision == "fail" else None
        return [c.detail for c in self.checks if c.passed is wanted]


def analyse(stable: VersionMetrics, canary: VersionMetrics, plan: RolloutPlan) -> Analysis:
    """Judge one step from the two versions' metrics over the same window."""
    t = plan.thresholds
    checks = [
        _requests(canary, plan.min_requests),
        _errors(stable, canary, t.max_error_rate_increase),
        _latency(stable, canary, t, plan.min_requests),
        _entropy(stable, canary),
        *(_custom(check, stable, canary) for check in plan.custom_checks),
    ]
    if any(c.passed is False for c in checks[1:]):
        decision: Decision = "fail"
    elif any(c.passed is None for c in checks):
        decision = "inconclusive"
    else:
        decision = "pass"
    return Analysis(decision, tuple(checks))


def _requests(canary: VersionMetrics, needed: int) -> CheckResult:
    enough = canary.requests >= needed
    detail = f"canary served {canary.requests:.0f} requests; {needed} needed to decide"
    return CheckResult("requests", True if enough else None, detail)


def _errors(stable: VersionMetrics, canary: VersionMetrics, allowed: float) -> CheckResult:
    bound = stable.error_rate + allowed
    detail = (
        f"canary error rate {canary.error_rate:.2%} vs stable {stable.error_rate:.2%} "
        f"(allowed up to {bound:.2%}: stable + {allowed:.2%})"
    )
    if canary.requests <= 0:
        return CheckResult("errors", None, "canary served no requests yet")
    return CheckResult("errors", canary.error_rate <= bound, detail)


def _latency(stable: VersionMetrics, canary: VersionMetrics, t: Thresholds, needed: int) -> CheckResult:
    if canary.p95_s is None or stable.p95_s is None or not math.isfinite(canary.p95_s + stable.p95_s):
        return CheckResult("latency", None, "p95 latency not measurable yet (no successful requests on a version)")
    if canary.requests < needed:
        # The p95 of a handful of requests is their slowest one (a cold first call): judge it on enough.
        return CheckResult("latency", None, f"p95 latency judged from {needed} canary requests on")
    bound = stable.p95_s * (1 + t.max_p95_increase)
    limit = max(bound, stable.p95_s + t.min_p95_delta_s)
    detail = (
        f"canary p95 {canary.p95_s * 1e3:.2f} ms vs stable {stable.p95_s * 1e3:.2f} ms "
        f"(allowed up to {bound * 1e3:.2f} ms: +{t.max_p95_increase:.0%}, "
        f"differences under {t.min_p95_delta_s * 1e3:.1f} ms ignored)"
    )
    if canary.p95_s <= limit:
        return CheckResult("latency", True, detail)
    if not canary.latency_buckets:
        return CheckResult("latency", False, detail)
    slower, total = requests_above(limit, canary.latency_buckets)
    p_value = slower_than_p95_p_value(slower, total)
    detail += f"; {slower} of {total} canary requests above {limit * 1e3:.2f} ms (binomial p = {p_value:.3g})"
    if p_value < t.latency_alpha:
        return CheckResult("latency", False, detail)
    return CheckResult("latency", True, f"{detail}: not significant at {t.latency_alpha:g}, passed")


def requests_above(limit: float, buckets: Sequence[tuple[float, float]]) -> tuple[int, int]:
    """(requests slower than ``limit``, all requests) from cumulative ``(upper bound, count)`` buckets.

    Inside the bucket holding ``limit`` the requests are taken as spread evenly, the assumption
    ``histogram_quantile`` makes, so the count agrees with the p95 read from the same buckets; the +Inf
    bucket's requests sit at the highest finite bound, where ``histogram_quantile`` puts them. Rounded
    down, so a doubtful request does not count against the canary.
    """
    ordered = sorted(buckets)
    if not ordered:
        return 0, 0
    total = ordered[-1][1]
    previous_bound, previous_count = 0.0, 0.0
    at_limit = total
    for bound, count in ordered:
        if limit < bound:
            if math.isinf(bound):
                at_limit = count
            else:
                at_limit = previous_count + (count - previous_count) * (limit - previous_bound) / (
                    bound - previous_bound
                )
            break
        previous_bound, previous_count = bound, count
    return math.floor(total - at_limit + 1e-9), round(total)


def slower_than_p95_p_value(slower: int, total: int) -> float:
    """One-sided binomial test: how likely ``slower`` or more of ``total`` requests exceed a latency that
    at most 5% of requests exceed (the limit is at least the p95 the canary is allowed). Small: the
    canary's p95 really is past the limit."""
    if total <= 0:
        return 1.0
    from scipy.stats import binomtest  # scipy is heavy to import and only the analysis needs it

    return float(binomtest(min(slower, total), total, 0.05, alternative="greater").pvalue)


def _entropy(stable: VersionMetrics, canary: VersionMetrics) -> CheckResult:
    if canary.entropy_collapsed is None:
        return CheckResult("entropy", True, "no output-entropy verdict exported (telemetry off): not checked")
    if canary.entropy_collapsed and stable.entropy_collapsed:
        # The same verdict on the same traffic: the inputs (not the canary) make every answer alike.
        return CheckResult("entropy", True, "stable and canary outputs both look collapsed: no difference to judge")
    if canary.entropy_collapsed:
        detail = "canary output entropy collapsed (std <= 0.05 bits) while stable's did not"
        return CheckResult("entropy", False, detail)
    return CheckResult("entropy", True, "canary output entropy varies normally")


def _custom(check: CustomCheck, stable: VersionMetrics, canary: VersionMetrics) -> CheckResult:
    value = canary.custom.get(check.name)
    if value is None or not math.isfinite(value):
        return CheckResult(f"custom:{check.name}", None, f"{check.name}: no value for the canary yet")
    bound = check.bound
    if check.relative:
        base = stable.custom.get(check.name)
        if base is None or not math.isfinite(base):
            return CheckResult(f"custom:{check.name}", None, f"{check.name}: no value for stable yet")
        bound = base + check.bound
    passed = _OPERATORS[check.op](value, bound)
    return CheckResult(f"custom:{check.name}", passed, f"{check.name} = {value:.6g} (expected {check.op} {bound:.6g})")


def progression_table(rows: Sequence[Mapping[str, object]]) -> str:
    """The canary progression as a markdown table (the Prefect artifact): one row per analysed read."""
    lines = [
        "| step | canary % | decision | canary requests | canary p95 ms | stable p95 ms | canary err % | reasons |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            "| {step} | {weight} | {decision} | {requests} | {cp95} | {sp95} | {err} | {reasons} |".format(
                step=row.get("step_index", ""),
                weight=row.get("canary_weight", ""),
                decision=row.get("decision", ""),
                requests=_fmt(row.get("canary_requests")),
                cp95=_ms(row.get("canary_p95_s")),
                sp95=_ms(row.get("stable_p95_s")),
                err=_pct(row.get("canary_error_rate")),
                reasons="; ".join(str(r) for r in row.get("reasons", []) or []) or "",  # type: ignore[attr-defined]
            )
        )
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else ""


def _ms(value: object) -> str:
    return f"{value * 1e3:.2f}" if isinstance(value, int | float) else ""


def _pct(value: object) -> str:
    return f"{value * 100:.2f}" if isinstance(value, int | float) else ""
