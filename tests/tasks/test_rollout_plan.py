"""tasks/rollout/plan.py and metrics.py's pure parts: the plan refuses what cannot run, each check passes,
fails or waits for the right reason, and histogram_quantile interpolates as Prometheus does."""

from __future__ import annotations

import math

import pytest

from tasks.rollout.metrics import ScrapeSnapshot, ScrapeSource, add_exposition, histogram_quantile
from tasks.rollout.plan import (
    CustomCheck,
    RolloutPlan,
    Thresholds,
    VersionMetrics,
    analyse,
    progression_table,
    requests_above,
)

STABLE = VersionMetrics(requests=1000, errors=2, p95_s=0.010, entropy_collapsed=False)


def canary(**changes: object) -> VersionMetrics:
    values: dict[str, object] = {"requests": 300, "errors": 0, "p95_s": 0.0105, "entropy_collapsed": False}
    values.update(changes)
    return VersionMetrics(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": (5, 20, 50)}, "last step must be 100"),
        ({"steps": (20, 5, 100)}, "increasing"),
        ({"steps": (0, 100)}, "increasing"),
        ({"hold_s": 0}, "positive"),
        ({"min_requests": 0}, "min_requests"),
        ({"pause_before": (30,)}, "not steps"),
    ],
)
def test_a_plan_that_cannot_run_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutPlan(**kwargs)  # type: ignore[arg-type]


def test_the_default_plan_is_designs() -> None:
    plan = RolloutPlan()
    assert plan.steps == (5, 20, 50, 100) and plan.analysed_steps == (5, 20, 50)


def test_a_healthy_canary_passes() -> None:
    result = analyse(STABLE, canary(), RolloutPlan(min_requests=200))
    assert result.decision == "pass", result
    assert result.reasons == []


def test_too_few_requests_is_inconclusive_not_a_pass() -> None:
    result = analyse(STABLE, canary(requests=50), RolloutPlan(min_requests=200))
    assert result.decision == "inconclusive"
    assert any("50 requests; 200 needed" in reason for reason in result.reasons)


@pytest.mark.parametrize(
    ("changes", "check", "needed"),
    [
        ({"p95_s": 0.0130}, "latency", 300),  # +30 % and +3 ms
        ({"errors": 3}, "errors", 1000),  # 1 % vs 0.2 % + 0.5 points: before enough requests too
        ({"entropy_collapsed": True}, "entropy", 1000),
    ],
)
def test_each_rule_fails_the_step(changes: dict[str, object], check: str, needed: int) -> None:
    result = analyse(STABLE, canary(requests=300, **changes), RolloutPlan(min_requests=needed))
    assert result.decision == "fail"
    failed = [c.name for c in result.checks if c.passed is False]
    assert failed == [check]


def test_a_slow_p95_of_a_few_requests_waits_for_more() -> None:
    result = analyse(STABLE, canary(requests=12, p95_s=0.030), RolloutPlan(min_requests=200))
    assert result.decision == "inconclusive"
    assert [c.passed for c in result.checks if c.name == "latency"] == [None]


def test_latency_differences_under_the_floor_never_fail() -> None:
    plan = RolloutPlan(min_requests=1, thresholds=Thresholds(max_p95_increase=0.1, min_p95_delta_s=0.002))
    fast = VersionMetrics(1000, 0, 0.0004)
    assert analyse(fast, canary(p95_s=0.0015), plan).decision == "pass"  # +275 % but only 1.1 ms
    assert analyse(fast, canary(p95_s=0.0030), plan).decision == "fail"  # and 2.6 ms


def test_error_rate_is_relative_to_stable() -> None:
    noisy_stable = VersionMetrics(1000, 50, 0.01)  # 5 %
    assert analyse(noisy_stable, canary(errors=16), RolloutPlan(min_requests=1)).decision == "pass"  # 5.3 %
    assert analyse(noisy_stable, canary(errors=17), RolloutPlan(min_requests=1)).decision == "fail"  # 5.7 %


def test_a_collapse_on_both_versions_is_the_traffic_not_the_canary() -> None:
    both = VersionMetrics(1000, 0, 0.01, entropy_collapsed=True)
    assert analyse(both, canary(entropy_collapsed=True), RolloutPlan(min_requests=1)).decision == "pass"


def test_custom_checks_absolute_and_relative() -> None:
    checks = (
        CustomCheck("rejects", "sum(rate(rejects{{version='{version}'}}[{window}]))", "<=", 0.01),
        CustomCheck("conversion", "conv", ">=", -0.02, relative=True),
    )
    plan = RolloutPlan(min_requests=1, custom_checks=checks)
    stable = VersionMetrics(1000, 0, 0.01, custom={"conversion": 0.30})
    good = canary(custom={"rejects": 0.005, "conversion": 0.29})
    assert analyse(stable, good, plan).decision == "pass"
    bad = canary(custom={"rejects": 0.005, "conversion": 0.25})
    result = analyse(stable, bad, plan)
    assert result.decision == "fail" and "conversion = 0.25 (expected >= 0.28)" in result.reasons[0]
    assert analyse(stable, canary(custom={"rejects": 0.005}), plan).decision == "inconclusive"
    with pytest.raises(ValueError, match="op"):
        CustomCheck("x", "q", "==")  # type: ignore[arg-type]


def test_histogram_quantile_matches_prometheus_rules() -> None:
    buckets = [(0.001, 10.0), (0.005, 90.0), (0.01, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.004 * (50 - 10) / 80)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.0005)  # the first bucket starts at 0
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.005 + 0.005 * 5 / 10)
    tail = [(0.001, 1.0), (0.005, 2.0), (math.inf, 10.0)]
    assert histogram_quantile(0.95, tail) == 0.005  # in +Inf: the highest finite bound
    assert histogram_quantile(0.95, [(0.001, 0.0), (math.inf, 0.0)]) is None


def test_scrape_snapshots_difference_per_version() -> None:
    before, after = ScrapeSnapshot(), ScrapeSnapshot()
    template = (
        'sluicegate_inference_requests_total{{model="m",version="{v}",code="{c}"}} {n}\n'
        'sluicegate_inference_request_duration_seconds_bucket{{model="m",version="{v}",le="0.01"}} {n}\n'
        'sluicegate_inference_request_duration_seconds_bucket{{model="m",version="{v}",le="+Inf"}} {n}\n'
    )
    add_exposition(before, "m", template.format(v="2", c="OK", n=10) + template.format(v="2", c="INTERNAL", n=1))
    add_exposition(after, "m", template.format(v="2", c="OK", n=40) + template.format(v="2", c="INTERNAL", n=4))
    add_exposition(after, "other", template.format(v="2", c="OK", n=999))  # another model: ignored
    assert after.requests[("2", "OK")] == 40 and after.requests[("2", "INTERNAL")] == 4
    assert ScrapeSource(["http://127.0.0.1:9/metrics"]).urls == ["http://127.0.0.1:9/metrics"]


def test_the_progression_table_has_a_row_per_step() -> None:
    table = progression_table(
        [
            {"step_index": 0, "canary_weight": 5, "decision": "pass", "canary_requests": 250.0, "canary_p95_s": 0.004},
            {"step_index": 1, "canary_weight": 20, "decision": "fail", "reasons": ["canary error rate 3.00%"]},
        ]
    )
    lines = table.splitlines()
    assert len(lines) == 4 and "| 0 | 5 | pass | 250 | 4.00 |" in lines[2] and "canary error rate 3.00%" in lines[3]


# The server's latency buckets (serving/observability/metrics.py) around these figures, in seconds.
BOUNDS = (0.001, 0.0025, 0.005, 0.01, math.inf)


def histogram(*counts: int) -> tuple[tuple[float, float], ...]:
    """Cumulative buckets from per-bucket counts."""
    running, out = 0, []
    for bound, count in zip(BOUNDS, counts, strict=True):
        running += count
        out.append((bound, float(running)))
    return tuple(out)


def version(buckets: tuple[tuple[float, float], ...]) -> VersionMetrics:
    return VersionMetrics(buckets[-1][1], 0, histogram_quantile(0.95, buckets), False, latency_buckets=buckets)


def test_requests_above_agrees_with_the_quantile_of_the_same_buckets() -> None:
    buckets = histogram(100, 700, 150, 40, 10)
    p95 = histogram_quantile(0.95, buckets)
    assert p95 is not None
    assert requests_above(p95, buckets) == (50, 1000)  # 5% of 1000 above the p95, by construction
    assert requests_above(0.0025, buckets) == (200, 1000)
    assert requests_above(0.02, buckets) == (0, 1000)  # above every finite bound: none counted
    assert requests_above(0.001, ()) == (0, 0)


def test_a_few_stalled_canary_requests_pass_a_really_slower_canary_fails() -> None:
    """CI's demo: a stall delayed 3 of the canary's 41 requests; its p95 went from 2 to 4.9 ms."""
    plan = RolloutPlan(min_requests=20)
    stable = version(histogram(139, 23, 0, 0, 0))  # p95 1.97 ms over 162 requests
    stalled = version(histogram(10, 26, 3, 2, 0))  # p95 4.96 ms over 41
    assert stalled.p95_s is not None and stable.p95_s is not None and stalled.p95_s > 2 * stable.p95_s
    judged = analyse(stable, stalled, plan)
    assert judged.decision == "pass", judged
    latency = next(c for c in judged.checks if c.name == "latency")
    assert latency.passed is True and "3 of 41" in latency.detail and "not significant" in latency.detail

    # The same p95 past the bound on most of the canary's requests: significant, and it fails at once.
    slower = version(histogram(0, 5, 30, 6, 0))
    failed = analyse(stable, slower, plan)
    assert failed.decision == "fail"
    assert [c.name for c in failed.checks if c.passed is False] == ["latency"]

    # The stall diluted by more requests in the same window: the p95 is back under the bound.
    later = version(histogram(60, 130, 3, 2, 0))
    assert analyse(stable, later, plan).decision == "pass"

    # A stricter significance fails less, a looser one more: the setting is what decides.
    assert analyse(
        stable, stalled, RolloutPlan(min_requests=20, thresholds=Thresholds(latency_alpha=0.5))
    ).decision == ("fail")
