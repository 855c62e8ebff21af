"""Gate 5's rules (DESIGN section 5): the candidate must beat the champion's accuracy by a margin and not
be slower than the champion by more than a factor at any measured batch size; the first model, with no
champion to compare with, must clear an absolute accuracy floor."""

from __future__ import annotations

from collections.abc import Sequence

from sluicegate.settings import EvalGateSettings
from tasks.evaluation import Evaluation
from tasks.verdicts import Check, GateVerdict

# Accuracies are ratios of counts; comparing k/n + 0.005 with m/n in floating point must not fail an
# exact tie by one ulp.
_EPS = 1e-9


def eval_gate(candidate: Evaluation, champion: Evaluation | None, rules: EvalGateSettings) -> GateVerdict:
    """The verdict on ``candidate`` (and ``champion``, the current one, or None for the first model)."""
    checks: list[Check] = []
    if champion is None:
        floor = rules.first_model_min_accuracy
        checks.append(
            Check(
                "accuracy (first model)",
                round(candidate.accuracy, 6),
                f">= {floor:g} (absolute floor: no champion yet)",
                candidate.accuracy + _EPS >= floor,
            )
        )
    else:
        required = champion.accuracy + rules.min_accuracy_gain
        checks.append(
            Check(
                "accuracy vs champion",
                round(candidate.accuracy, 6),
                f">= {required:.4f} (champion {champion.accuracy:.4f} + {rules.min_accuracy_gain:g})",
                candidate.accuracy + _EPS >= required,
            )
        )
        checks.extend(latency_checks(candidate, champion, rules))
    if rules.max_p95_ms is not None:
        for entry in candidate.latency:
            checks.append(
                Check(
                    f"p95 latency @ batch {entry.batch_size} (ceiling)",
                    round(entry.p95_ms, 4),
                    f"<= {rules.max_p95_ms:g} ms",
                    entry.p95_ms <= rules.max_p95_ms,
                )
            )
    return GateVerdict("eval", tuple(checks), metrics=summary(candidate, champion))


def latency_checks(candidate: Evaluation, champion: Evaluation, rules: EvalGateSettings) -> list[Check]:
    checks = []
    for entry in candidate.latency:
        theirs = champion.latency_at(entry.batch_size)
        if theirs is None:
            continue
        # The ratio, but never tighter than the noise floor: 0.17 vs 0.31 ms is a scheduler, not a model.
        bound = max(theirs.p95_ms * rules.max_latency_ratio, theirs.p95_ms + rules.min_latency_delta_ms)
        checks.append(
            Check(
                f"p95 latency @ batch {entry.batch_size}",
                round(entry.p95_ms, 4),
                f"<= {bound:.4f} ms (champion {theirs.p95_ms:.4f} ms x {rules.max_latency_ratio:g}, "
                f"at least + {rules.min_latency_delta_ms:g} ms)",
                entry.p95_ms <= bound,
                f"ratio {entry.p95_ms / theirs.p95_ms:.3f}" if theirs.p95_ms > 0 else "",
            )
        )
    return checks


def only_latency_failed(evaluations: Sequence[Evaluation], rules: EvalGateSettings) -> bool:
    """True when the champion comparison fails on latency alone: the case worth re-measuring."""
    if len(evaluations) < 2:
        return False
    verdict = eval_gate(evaluations[0], evaluations[1], rules)
    return bool(verdict.failed) and all(check.name.startswith("p95 latency") for check in verdict.failed)


def summary(candidate: Evaluation, champion: Evaluation | None) -> dict[str, object]:
    """The headline numbers of both models, flat, for the gate-result row and MLflow metrics."""
    out: dict[str, object] = {"candidate_version": candidate.model_version}
    for prefix, evaluation in (("candidate", candidate), ("champion", champion)):
        if evaluation is None:
            continue
        out[f"{prefix}_version"] = evaluation.model_version
        out[f"{prefix}_accuracy"] = evaluation.accuracy
        out[f"{prefix}_ece"] = evaluation.ece
        out[f"{prefix}_runtime"] = f"{evaluation.runtime} ({', '.join(evaluation.providers)})"
        for entry in evaluation.latency:
            out[f"{prefix}_p50_ms_b{entry.batch_size}"] = entry.p50_ms
            out[f"{prefix}_p95_ms_b{entry.batch_size}"] = entry.p95_ms
    out["samples"] = candidate.samples
    return out
