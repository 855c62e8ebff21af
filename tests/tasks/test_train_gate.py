"""The train gate on hand-made loss curves: first run, divergence, roughness and drift from history."""

from __future__ import annotations

import json
import math

import pytest

from sluicegate.settings import TrainGateSettings
from tasks.train_gate import HistoryRun, gate_metrics, history_from_metrics, roughness, train_gate

SETTINGS = TrainGateSettings()
# A typical curve: fast at first, then levelling off (roughness ~0.04, under the default 0.1).
SMOOTH = [1.4, 1.1, 0.85, 0.66, 0.52, 0.42, 0.35, 0.30, 0.27, 0.25, 0.24, 0.235]
GiB = 1 << 30


def names(verdict: object) -> list[str]:
    return [check.name for check in verdict.checks]  # type: ignore[attr-defined]


def check(verdict: object, name: str) -> object:
    (found,) = [c for c in verdict.checks if c.name == name]  # type: ignore[attr-defined]
    return found


def history(final: float = 0.235, peak: int = GiB, runs: int = 3) -> list[HistoryRun]:
    return [HistoryRun(final_loss=final, peak_memory_bytes=peak) for _ in range(runs)]


def test_first_run_passes_with_only_finiteness_and_smoothness() -> None:
    verdict = train_gate(SMOOTH, GiB, [], SETTINGS)
    assert verdict.passed, verdict.reason()
    assert verdict.gate == "train"
    assert names(verdict) == ["finite loss", "loss smoothness", "history"]
    assert check(verdict, "history").observed == "first run"  # type: ignore[attr-defined]
    assert check(verdict, "loss smoothness").threshold == "<= 0.1"  # type: ignore[attr-defined]
    assert verdict.metrics["history_runs"] == 0


def test_nan_fails_finite_loss_only() -> None:
    verdict = train_gate([1.4, 1.1, math.nan], GiB, [], SETTINGS)
    assert not verdict.passed
    assert [c.name for c in verdict.failed] == ["finite loss"]
    assert check(verdict, "finite loss").observed == 1  # type: ignore[attr-defined]
    assert "epoch(s) [3]" in check(verdict, "finite loss").detail  # type: ignore[attr-defined]
    # Metrics stay valid JSON (no NaN) so the metadata store can hold them.
    json.dumps(verdict.to_dict(), allow_nan=False)


def test_inf_fails_finite_loss_and_final_loss_vs_history() -> None:
    verdict = train_gate([1.4, 1.1, math.inf], GiB, history(), SETTINGS)
    assert {c.name for c in verdict.failed} == {"finite loss", "final loss vs history"}
    json.dumps(verdict.to_dict(), allow_nan=False)


def test_zig_zag_curve_fails_smoothness() -> None:
    zigzag = [1.4, 0.6, 1.2, 0.5, 1.1, 0.45, 1.0, 0.4]
    verdict = train_gate(zigzag, GiB, [], SETTINGS)
    assert [c.name for c in verdict.failed] == ["loss smoothness"]
    assert check(verdict, "loss smoothness").observed > 1.0  # type: ignore[attr-defined]


def test_short_and_flat_curves_have_zero_roughness() -> None:
    assert roughness([3.0, 1.0]) == 0.0
    assert roughness([0.5, 0.5, 0.5, 0.5]) == 0.0
    assert roughness([1.0, 0.5, 0.0]) == 0.0  # a straight line has no curvature
    assert train_gate([2.0, 1.0], GiB, [], SETTINGS).passed


def test_final_loss_20_percent_above_history_fails() -> None:
    curve = [*SMOOTH[:-1], 0.235 * 1.2]
    verdict = train_gate(curve, GiB, history(), SETTINGS)
    assert [c.name for c in verdict.failed] == ["final loss vs history"]
    assert check(verdict, "final loss vs history").observed == pytest.approx(0.2, abs=1e-6)  # type: ignore[attr-defined]


def test_within_history_passes_with_both_history_checks() -> None:
    verdict = train_gate(SMOOTH, int(GiB * 1.05), history(final=0.24), SETTINGS)
    assert verdict.passed, verdict.reason()
    assert names(verdict) == ["finite loss", "loss smoothness", "final loss vs history", "peak memory vs history"]
    assert verdict.metrics["history_runs"] == 3


def test_memory_30_percent_above_history_fails() -> None:
    verdict = train_gate(SMOOTH, int(GiB * 1.3), history(), SETTINGS)
    assert [c.name for c in verdict.failed] == ["peak memory vs history"]
    assert check(verdict, "peak memory vs history").observed == pytest.approx(0.3, abs=1e-6)  # type: ignore[attr-defined]


def test_thresholds_come_from_settings() -> None:
    loose = TrainGateSettings(max_roughness=2.0, final_loss_tolerance=0.25, memory_tolerance=0.35)
    zigzag = [1.4, 0.6, 1.2, 0.5, 1.1, 0.45, 1.0, 0.4]
    # Same run, same history: fails the defaults on every history check, passes the loose bounds.
    curve = [*zigzag[:-1], 0.235 * 1.2]
    assert not train_gate(curve, int(GiB * 1.3), history(), SETTINGS).passed
    verdict = train_gate(curve, int(GiB * 1.3), history(), loose)
    assert verdict.passed, verdict.reason()
    assert [c.threshold for c in verdict.checks[1:]] == ["<= 2", "<= 0.25 above", "<= 0.35 above"]
    strict = TrainGateSettings(max_roughness=0.01)
    assert [c.name for c in train_gate(SMOOTH, GiB, [], strict).failed] == ["loss smoothness"]


def test_a_lower_loss_and_memory_than_history_pass() -> None:
    # A larger or cleaner dataset version learns more: far below the history is not instability.
    verdict = train_gate(SMOOTH, GiB // 2, history(final=0.9, peak=GiB), SETTINGS)
    assert verdict.passed, verdict.reason()
    assert check(verdict, "final loss vs history").observed < -0.7  # type: ignore[attr-defined]
    assert check(verdict, "peak memory vs history").observed == pytest.approx(-0.5, abs=1e-6)  # type: ignore[attr-defined]


def test_only_the_last_history_runs_count() -> None:
    # Ten old runs at half the loss and memory, then three like this one: with history_runs=3 only those count.
    old = history(final=0.1175, peak=GiB // 2, runs=10)
    recent = history(final=0.235, peak=GiB, runs=3)
    assert train_gate(SMOOTH, GiB, old + recent, TrainGateSettings(history_runs=3)).passed
    assert not train_gate(SMOOTH, GiB, old + recent, TrainGateSettings(history_runs=13)).passed


def test_history_from_metrics_round_trip() -> None:
    runs = [([1.0, 0.6, 0.5], 900), ([1.1, 0.7, 0.52], 1000), ([1.2, 0.8, math.nan], 1100)]
    stored = [json.loads(json.dumps(gate_metrics(curve, peak), allow_nan=False)) for curve, peak in runs]
    # The diverged third run describes no stable run, so it is not history; an unrelated entry neither.
    assert history_from_metrics([*stored, {"accuracy": 0.9}]) == [
        HistoryRun(final_loss=0.5, peak_memory_bytes=900),
        HistoryRun(final_loss=0.52, peak_memory_bytes=1000),
    ]
    verdict = train_gate([1.0, 0.76, 0.51], 950, history_from_metrics(stored), SETTINGS)
    assert verdict.passed, verdict.reason()
    # A verdict's own metrics are what the next run reads back.
    assert history_from_metrics([verdict.metrics]) == [HistoryRun(final_loss=0.51, peak_memory_bytes=950)]
