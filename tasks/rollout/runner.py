"""Runs a rollout plan on a platform: start the canary, then per step set the weight, hold, read the
metrics every ``analysis_interval_s`` and judge (tasks/rollout/plan.py), and at 100 promote; a failing
check rolls back at once, without waiting for the hold to end.

Resumable: the platform's state says where a crashed run stopped (the canary already running, its
weight), and the run continues from the first step at or above that weight. An operator acting on the
platform meanwhile (``sluicegate rollout abort`` / ``promote``) is noticed at the next read and ends
the run accordingly. No Prefect here: flows/rollout.py wraps this with the metadata rows, the Prefect
artifact, the alias moves and a pause between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.rollout.metrics import MetricsSource
from tasks.rollout.plan import Analysis, RolloutPlan, analyse
from tasks.rollout.platform import PlatformError, RolloutPlatform

log = logging.getLogger(__name__)

Status = Literal["promoted", "rolled_back", "aborted"]


@dataclass
class Outcome:
    status: Status
    reason: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # one row per judged step (the progression)
    detected_after_s: float | None = None  # failing step: seconds from setting its weight to the rollback


@dataclass
class Hooks:
    """What the caller learns or decides along the way (all optional)."""

    on_step: Callable[[dict[str, Any]], None] | None = None  # every analysis read (a step's row, replaced)
    before_step: Callable[[int, int], None] | None = None  # (index, weight): e.g. a manual pause
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


def run_rollout(
    model: str,
    version: str,
    *,
    platform: RolloutPlatform,
    source: MetricsSource,
    plan: RolloutPlan,
    hooks: Hooks | None = None,
) -> Outcome:
    """Roll ``version`` of ``model`` out by ``plan``; never raises for a bad canary (that is an Outcome).

    Raises:
        PlatformError: the platform refused or timed out (the canary is rolled back first when one runs).
    """
    hooks = hooks or Hooks()
    state = platform.state(model)
    if state.stable_version == version and state.canary_version is None:
        return Outcome("promoted", f"{model} {version} is already stable (nothing left to do)")
    adopt = getattr(platform, "adopt", None)
    if state.stable_version is None and adopt is not None:
        # The first version: nothing to compare a canary with (Argo Rollouts does the same).
        adopt(model, version)
        return Outcome("promoted", f"first version of {model}: deployed at 100% with no stable to compare with")
    if state.canary_version not in (None, version):
        raise PlatformError(
            f"{model} has a canary of another version ({state.canary_version}) in progress: "
            "`sluicegate rollout abort` it first"
        )
    try:
        if state.canary_version != version:
            state = platform.start_canary(model, version)
        outcome = Outcome("promoted", "")
        for index, weight in enumerate(plan.steps):
            if weight < state.canary_weight:
                continue  # passed before a crash: its row is already recorded
            if hooks.before_step is not None:
                hooks.before_step(index, weight)
            if weight == 100:
                platform.promote(model)
                outcome.reason = f"every step passed ({', '.join(f'{s}%' for s in plan.analysed_steps)}); promoted"
                return outcome
            ended = _hold(model, version, index, weight, platform, source, plan, hooks, outcome)
            if ended is not None:
                return ended
        return outcome  # unreachable: the plan ends at 100
    except PlatformError:
        _safe_rollback(platform, model)
        raise


def _hold(
    model: str,
    version: str,
    index: int,
    weight: int,
    platform: RolloutPlatform,
    source: MetricsSource,
    plan: RolloutPlan,
    hooks: Hooks,
    outcome: Outcome,
) -> Outcome | None:
    """One step: set the weight, read and judge every interval until the hold ends; an Outcome ends
    the rollout (failed, or an operator acted), None moves on to the next step."""
    state = platform.set_weight(model, weight)
    started = hooks.clock()
    mark = source.begin(model)
    deadline = started + plan.hold_s
    waits_left = plan.max_inconclusive
    while True:
        hooks.sleep(min(plan.analysis_interval_s, max(0.0, deadline - hooks.clock())) or plan.analysis_interval_s)
        state = platform.state(model)
        if state.canary_version != version:  # someone acted on the platform
            if state.stable_version == version:
                return Outcome("promoted", "promoted by an operator", outcome.steps)
            return Outcome("aborted", "aborted by an operator (the canary was removed)", outcome.steps)
        stable_version = state.stable_version or ""
        stable = source.read(model, stable_version, mark, plan.custom_checks)
        canary = source.read(model, version, mark, plan.custom_checks)
        analysis = analyse(stable, canary, plan)
        row = _row(index, weight, analysis, stable.as_dict(), canary.as_dict(), hooks.clock() - started)
        done = hooks.clock() >= deadline
        if analysis.decision == "inconclusive" and done and waits_left == 0:
            row["decision"] = "fail"
            row["reasons"] = [f"still inconclusive after {plan.max_inconclusive} extra intervals", *row["reasons"]]
        _record(outcome, row, hooks)
        if row["decision"] == "fail":
            platform.rollback(model)
            reason = f"step {index} ({weight}%) failed: " + "; ".join(row["reasons"])
            return Outcome("rolled_back", reason, outcome.steps, hooks.clock() - started)
        if done and analysis.decision == "pass":
            return None
        if done:
            waits_left -= 1


def _row(
    index: int, weight: int, analysis: Analysis, stable: dict[str, Any], canary: dict[str, Any], held: float
) -> dict[str, Any]:
    return {
        "step_index": index,
        "canary_weight": weight,
        "stable_weight": 100 - weight,
        "decision": analysis.decision,
        "reasons": analysis.reasons,
        "checks": {c.name: {"passed": c.passed, "detail": c.detail} for c in analysis.checks},
        "held_s": round(held, 3),
        "canary_requests": canary["requests"],
        "canary_p95_s": canary["p95_s"],
        "stable_p95_s": stable["p95_s"],
        "canary_error_rate": canary["error_rate"],
        "stable": stable,
        "canary": canary,
    }


def _record(outcome: Outcome, row: dict[str, Any], hooks: Hooks) -> None:
    if outcome.steps and outcome.steps[-1]["step_index"] == row["step_index"]:
        outcome.steps[-1] = row  # the step's latest read replaces its earlier ones
    else:
        outcome.steps.append(row)
    if hooks.on_step is not None:
        hooks.on_step(row)


def _safe_rollback(platform: RolloutPlatform, model: str) -> None:
    try:
        platform.rollback(model)
    except PlatformError:
        log.exception("rollback of %s after a platform error failed too; check the platform by hand", model)
