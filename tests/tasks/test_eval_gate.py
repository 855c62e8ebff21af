"""Gate 5's rules on given measurements (the measurements themselves: test_evaluation.py)."""

from __future__ import annotations

import pytest

from sluicegate.settings import EvalGateSettings
from tasks.eval_gate import eval_gate, only_latency_failed
from tasks.evaluation import ClassMetrics, Evaluation, Latency

RULES = EvalGateSettings()


def measured(accuracy: float, p95: tuple[float, float] = (1.0, 4.0), role: str = "candidate") -> Evaluation:
    return Evaluation(
        role=role,
        model_version=f"v1.0.0-aaaaaaa-{role[:7]:0<7}",
        runtime="onnxruntime",
        providers=("CPUExecutionProvider",),
        model_labels=("bridge", "good"),
        samples=200,
        accuracy=accuracy,
        ece=0.05,
        axis=("bridge", "good"),
        confusion=((90, 10), (10, 90)),
        per_class=(ClassMetrics("bridge", 0.9, 0.9, 0.9, 100), ClassMetrics("good", 0.9, 0.9, 0.9, 100)),
        calibration=(),
        latency=(Latency(1, p95[0] * 0.8, p95[0], p95[0] * 0.85, 300), Latency(8, p95[1] * 0.8, p95[1], p95[1], 300)),
        unknown_label_samples=0,
    )


def test_a_better_candidate_passes() -> None:
    verdict = eval_gate(measured(0.93), measured(0.90, role="champion"), RULES)
    assert verdict.passed, verdict.reason()
    assert [c.name for c in verdict.checks] == [
        "accuracy vs champion",
        "p95 latency @ batch 1",
        "p95 latency @ batch 8",
    ]
    assert verdict.metrics["champion_accuracy"] == 0.90 and verdict.metrics["candidate_p95_ms_b8"] == 4.0


@pytest.mark.parametrize("accuracy", [0.90, 0.904, 0.85])
def test_not_better_by_half_a_point_fails(accuracy: float) -> None:
    verdict = eval_gate(measured(accuracy), measured(0.90, role="champion"), RULES)
    assert not verdict.passed
    assert [c.name for c in verdict.failed] == ["accuracy vs champion"]
    assert "(champion 0.9000 + 0.005)" in verdict.reason()


def test_exactly_half_a_point_better_passes() -> None:
    # 181/200 - 180/200 is 0.005 up to rounding; an exact tie with the rule must not fail on an ulp.
    assert eval_gate(measured(181 / 200), measured(180 / 200, role="champion"), RULES).passed


def test_the_latency_rule_trips_at_any_batch_size() -> None:
    champion = measured(0.90, (1.0, 4.0), role="champion")
    verdict = eval_gate(measured(0.95, (1.05, 4.6)), champion, RULES)
    assert [c.name for c in verdict.failed] == ["p95 latency @ batch 8"]
    assert verdict.failed[0].detail == "ratio 1.150"
    assert only_latency_failed([measured(0.95, (1.05, 4.6)), champion], RULES)
    assert not only_latency_failed([measured(0.80, (1.05, 4.6)), champion], RULES)  # accuracy fails too


def test_the_first_model_meets_an_absolute_floor() -> None:
    assert eval_gate(measured(0.85), None, RULES).passed
    verdict = eval_gate(measured(0.62), None, RULES)
    assert not verdict.passed
    assert (
        verdict.reason()
        == "eval gate failed: accuracy (first model) observed 0.62 (required >= 0.8 (absolute floor: no champion yet))"
    )
    assert eval_gate(measured(0.62), None, EvalGateSettings(first_model_min_accuracy=0.6)).passed


def test_an_absolute_latency_ceiling_applies_with_or_without_a_champion() -> None:
    rules = EvalGateSettings(max_p95_ms=3.0)
    verdict = eval_gate(measured(0.9, (1.0, 4.0)), None, rules)
    assert [c.name for c in verdict.failed] == ["p95 latency @ batch 8 (ceiling)"]


def test_thresholds_are_settings() -> None:
    rules = EvalGateSettings(min_accuracy_gain=0.0, max_latency_ratio=2.0)
    assert eval_gate(measured(0.90, (1.9, 7.9)), measured(0.90, role="champion"), rules).passed


def test_sub_millisecond_differences_under_the_noise_floor_do_not_fail() -> None:
    champion = measured(0.90, (0.17, 0.5), role="champion")
    noisy = measured(0.93, (0.31, 0.52))  # 1.8x the champion at batch 1, but 0.14 ms: scheduling noise
    assert eval_gate(noisy, champion, RULES).passed
    strict = EvalGateSettings(min_latency_delta_ms=0.0)
    assert [c.name for c in eval_gate(noisy, champion, strict).failed] == ["p95 latency @ batch 1"]
    slower = measured(0.93, (0.45, 0.52))  # past the ratio and past the floor
    assert [c.name for c in eval_gate(slower, champion, RULES).failed] == ["p95 latency @ batch 1"]
