"""The train gate on hand-made loss curves: first run, divergence, roughness and drift from history.

Real training runs through the gate are in test_train_gate_runs.py.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from sluicegate.settings import TrainGateSettings
from tasks.train_gate import (
    SMOOTH_POINTS,
    HistoryRun,
    comparable_runs,
    gate_metrics,
    history_from_metrics,
    loss_rise,
    roughness,
    smoothed_curve,
    train_gate,
)

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
    assert names(verdict) == ["finite loss", "loss smoothness", "loss rise", "history"]
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
    assert names(verdict) == [
        "finite loss",
        "loss smoothness",
        "loss rise",
        "final loss vs history",
        "peak memory vs history",
    ]
    assert verdict.metrics["history_runs"] == 3


def test_memory_30_percent_above_history_fails() -> None:
    verdict = train_gate(SMOOTH, int(GiB * 1.3), history(), SETTINGS)
    assert [c.name for c in verdict.failed] == ["peak memory vs history"]
    assert check(verdict, "peak memory vs history").observed == pytest.approx(0.3, abs=1e-6)  # type: ignore[attr-defined]


def test_thresholds_come_from_settings() -> None:
    loose = TrainGateSettings(max_roughness=2.0, final_loss_tolerance=0.25, memory_tolerance=0.35, max_loss_rise=3)
    zigzag = [1.4, 0.6, 1.2, 0.5, 1.1, 0.45, 1.0, 0.4]
    # Same run, same history: fails the defaults on every history check, passes the loose bounds.
    curve = [*zigzag[:-1], 0.235 * 1.2]
    assert not train_gate(curve, int(GiB * 1.3), history(), SETTINGS).passed
    verdict = train_gate(curve, int(GiB * 1.3), history(), loose)
    assert verdict.passed, verdict.reason()
    assert [c.threshold for c in verdict.checks[1:]] == [
        "<= 2",
        "<= 3 x the first step's",
        "<= 0.25 above",
        "<= 0.35 above",
    ]
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


def noisy_decay(steps: int, seed: int, noise: float = 0.25) -> list[float]:
    """Step losses of a healthy run: exponential decay from ln 2 times multiplicative batch noise."""
    rng = random.Random(seed)
    return [(0.05 + 0.65 * math.exp(-step / (steps / 6))) * (1 + noise * rng.uniform(-1, 1)) for step in range(steps)]


def epoch_means(steps: list[float], per_epoch: int) -> list[float]:
    return [sum(steps[i : i + per_epoch]) / len(steps[i : i + per_epoch]) for i in range(0, len(steps), per_epoch)]


def test_smoothed_curve_has_fixed_points_of_moving_means() -> None:
    steps = [float(i) for i in range(200)]
    curve = smoothed_curve(steps)
    assert len(curve) == SMOOTH_POINTS
    # A straight line stays one: each point is the mean of a 20-step window centred on its tenth of the run.
    assert curve[5] == pytest.approx(sum(range(45, 65)) / 20)
    assert roughness(curve) < 0.02
    # Short runs are read as they are, non-finite steps left out (the finiteness check reports them).
    assert smoothed_curve([1.0, math.nan, 0.5]) == [1.0, 0.5]
    assert len(smoothed_curve([*steps[:100], math.nan, *steps[101:]])) == SMOOTH_POINTS


def test_batch_noise_of_a_small_set_passes_on_the_smoothed_steps() -> None:
    """The refused real case: 140 images at batch 64 give 3 steps an epoch; their per-epoch means are rough
    by chance, the smoothed per-step curve of the same run is not."""
    for seed in range(20):
        steps = noisy_decay(180, seed)
        verdict = train_gate(epoch_means(steps, 3), GiB, [], SETTINGS, step_losses=steps)
        assert verdict.passed, (seed, verdict.reason())
        assert check(verdict, "loss smoothness").observed < 0.05  # type: ignore[attr-defined]
    # The same runs cut to 8 epochs and read per epoch, as before step losses: some are refused.
    short = [epoch_means(noisy_decay(24, seed, noise=0.6), 3) for seed in range(20)]
    assert any(not train_gate(curve, GiB, [], SETTINGS).passed for curve in short)


def test_an_oscillating_run_fails_smoothness_on_the_steps() -> None:
    steps = [0.4 + 0.3 * math.sin(step / 6) for step in range(240)]
    verdict = train_gate(epoch_means(steps, 24), GiB, [], SETTINGS, step_losses=steps)
    assert [c.name for c in verdict.failed] == ["loss smoothness"]


def test_a_loss_that_leaps_and_creeps_back_fails_loss_rise() -> None:
    """A learning rate far too high: the loss leaps a thousandfold in the first steps, then the cosine
    schedule brings it down. Scaled to [0, 1] that is a smooth decay; against the first step it is not."""
    steps = [0.69, *(700 * math.exp(-step / 15) + 0.5 for step in range(1, 120))]
    verdict = train_gate(epoch_means(steps, 12), GiB, [], SETTINGS, step_losses=steps)
    assert [c.name for c in verdict.failed] == ["loss rise"]
    assert check(verdict, "loss rise").observed > 100  # type: ignore[attr-defined]
    assert check(verdict, "loss smoothness").passed  # type: ignore[attr-defined]
    # A healthy run peaks at its start.
    healthy = noisy_decay(180, 0)
    assert loss_rise(smoothed_curve(healthy), healthy[0]) < 1.0
    assert loss_rise([], 0.7) == 0.0 and loss_rise([1.0], math.nan) == 0.0


def test_metrics_with_steps_are_json_and_older_records_still_load() -> None:
    steps = [*noisy_decay(100, 1), math.nan, math.inf]
    metrics = gate_metrics([0.5, 0.3, math.nan], 900, steps)
    stored = json.loads(json.dumps(metrics, allow_nan=False))
    assert stored["steps"] == 102 and len(stored["smoothed_loss_curve"]) == SMOOTH_POINTS
    assert stored["initial_loss"] == pytest.approx(steps[0])
    # A record from before step losses and loss rise were recorded.
    older = {"train_loss_curve": [1.0, 0.6, 0.5], "final_loss": 0.5, "peak_memory_bytes": 900, "roughness": 0.1}
    assert history_from_metrics([older, stored]) == [HistoryRun(final_loss=0.5, peak_memory_bytes=900)]


def test_a_run_of_a_few_steps_is_judged_on_its_epochs_and_its_first_step() -> None:
    # Two epochs of three noisy batches: too few steps for moving means; the two epoch means are smooth.
    steps = [1.4, 0.9, 1.3, 0.8, 1.1, 0.7]
    passed = train_gate([1.2, 0.87], 1000, [], TrainGateSettings(), step_losses=steps)
    assert passed.passed, passed.reason()
    # A blow-up inside the first epoch still shows against the first step's loss.
    blown = train_gate([500.0, 3.0], 1000, [], TrainGateSettings(), step_losses=[0.7, 1500.0, 1.0, 3.0, 3.0, 3.0])
    assert not blown.passed and "loss rise" in blown.reason()


def test_history_is_earlier_runs_of_the_same_model_with_a_like_epoch_budget() -> None:
    recorded = [
        {"model_name": "digits", "epochs": 48, "final_loss": 0.1, "peak_memory_bytes": GiB},
        {"model_name": "digits", "epochs": 20, "final_loss": 0.3, "peak_memory_bytes": GiB},
        {"model_name": "pcb", "epochs": 19, "final_loss": 0.2, "peak_memory_bytes": GiB},
        {"model_name": "digits", "final_loss": 0.35, "peak_memory_bytes": GiB},  # recorded before epochs were
        {"model_name": "digits", "epochs": 17, "final_loss": 0.32, "peak_memory_bytes": GiB},
    ]
    chosen = comparable_runs(recorded, model="digits", epochs=19, limit=10)
    assert [entry["final_loss"] for entry in chosen] == [0.3, 0.35, 0.32]
    assert comparable_runs(recorded, model="digits", epochs=19, limit=2) == chosen[:2]
    # The 48-epoch run's lower final loss is not a bar for a 19-epoch run of a larger set.
    verdict = train_gate(SMOOTH, GiB, history_from_metrics(chosen), SETTINGS)
    assert check(verdict, "final loss vs history").passed  # type: ignore[attr-defined]
