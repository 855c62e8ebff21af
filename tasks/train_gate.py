"""Gate 3, the train gate: was the training run itself stable, and like the earlier runs of this model?

DESIGN section 5: the training loss is finite, smooth and never far above where it started; with a history
of earlier runs of the same model, the final loss is within a tolerance of their mean, and so is the peak
memory. The first run has no history: it is held to the checks of the run alone, and its metrics become the
history of the next.

Smoothness is read from every training step's loss, not from per-epoch means: the step losses are
averaged over moving windows into 20 evenly spaced points (each point the mean of a tenth of the run,
centred on it), and the roughness is the mean absolute second difference of that curve scaled to [0, 1].
A short run on a small dataset has a handful of epochs, where one uneven epoch decides the score; 20
points of a tenth of the run each average out batch noise, and still show a loss that oscillates or climbs.

Scaling to [0, 1] hides how far a loss went: a run whose loss leaps a thousandfold in its first steps and
then creeps back looks like a smooth decay. So "loss rise" bounds the smoothed curve's peak by a multiple
of the first step's loss, the loss of the untrained model (about ln(classes)).

The history is read back from the metrics this gate recorded (``gate_metrics``, ``history_from_metrics``),
so the metadata store needs no table of its own for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluicegate.settings import TrainGateSettings
from tasks.verdicts import Check, GateVerdict

GATE = "train"
# The smoothed curve: this many points, each the mean of the steps in a window of WINDOW of the run centred
# on it. Twenty points resolve the shape of a run (the early drop, the plateau, a late climb); a window of
# a tenth of the run (twice the spacing, so neighbouring windows overlap by half) averages a run of a few
# hundred steps over tens of batches per point, which brings batch-to-batch noise well under the bound.
SMOOTH_POINTS = 20
WINDOW = 0.1
# Fewer steps than this are judged on the per-epoch curve (two steps per point at least).
MIN_STEPS = 2 * SMOOTH_POINTS


@dataclass(frozen=True)
class HistoryRun:
    """What the gate compares against from one earlier run of the same model."""

    final_loss: float
    peak_memory_bytes: int


def roughness(curve: Sequence[float]) -> float:
    """Mean |second difference| of the curve scaled to [0, 1] by its min and max.

    Scaling makes the bound independent of the loss's units and level; a flat curve (max == min) and one
    shorter than 3 points have no curvature to measure and score 0. Non-finite points are left out: the
    finiteness check reports them, and one defect should fail one check.
    """
    values = [float(v) for v in curve if math.isfinite(v)]
    if len(values) < 3:
        return 0.0
    low, high = min(values), max(values)
    if high == low:
        return 0.0
    scaled = [(v - low) / (high - low) for v in values]
    seconds = [abs(scaled[i + 2] - 2 * scaled[i + 1] + scaled[i]) for i in range(len(scaled) - 2)]
    return sum(seconds) / len(seconds)


def smoothed_curve(step_losses: Sequence[float], points: int = SMOOTH_POINTS) -> list[float]:
    """``points`` evenly spaced moving means of the step losses, each over ``WINDOW`` of the run.

    A run of at most ``points`` steps is returned as it is (finite values only). Non-finite steps are left
    out of the means, and a window with no finite step gives no point: the finiteness check reports them.
    """
    values = [float(v) for v in step_losses]
    if len(values) <= points:
        return [v for v in values if math.isfinite(v)]
    half = max(WINDOW * len(values), 1.0) / 2
    curve = []
    for index in range(points):
        centre = (index + 0.5) * len(values) / points
        window = values[max(0, math.floor(centre - half)) : min(len(values), math.ceil(centre + half))]
        finite = [v for v in window if math.isfinite(v)]
        if finite:
            curve.append(math.fsum(finite) / len(finite))
    return curve


def loss_rise(smoothed: Sequence[float], start: float) -> float:
    """Peak of the smoothed curve over the starting loss; 0 when either is missing (nothing to compare:
    the finiteness check reports a run without finite losses)."""
    values = [float(v) for v in smoothed if math.isfinite(v)]
    if not values or not math.isfinite(start):
        return 0.0
    if start <= 0:
        return 0.0 if max(values) <= 0 else math.inf
    return max(values) / start


def gate_metrics(curve: Sequence[float], peak_memory_bytes: int, step_losses: Sequence[float] = ()) -> dict[str, Any]:
    """The metrics a train-gate verdict records: enough for ``history_from_metrics`` to rebuild a run.

    ``roughness`` and ``loss_rise`` read ``smoothed_curve(step_losses)`` and the first finite step loss
    when there are step losses, else the per-epoch ``curve`` and its first finite point (as before step
    losses were recorded). Non-finite losses are written as None: the metrics are stored as JSON, which
    has no NaN or Infinity.
    """
    points = [float(v) if math.isfinite(v) else None for v in curve]
    # A run of a few dozen steps has too few for moving means (each window would hold one or two noisy
    # batches): its per-epoch means are the smoother view, as before step losses were recorded.
    use_steps = len(step_losses) >= MIN_STEPS
    # The start is the untrained model's loss whenever steps were recorded (an epoch mean already holds
    # a blow-up of the first steps).
    raw = step_losses if step_losses else curve
    smoothed = smoothed_curve(step_losses) if use_steps else [float(v) for v in curve if math.isfinite(v)]
    start = next((float(v) for v in raw if math.isfinite(v)), math.nan)
    return {
        "train_loss_curve": points,
        "final_loss": points[-1] if points else None,
        "peak_memory_bytes": int(peak_memory_bytes),
        "roughness": roughness(smoothed),
        "smoothed_loss_curve": smoothed,
        "initial_loss": start if math.isfinite(start) else None,
        "loss_rise": _shown(loss_rise(smoothed, start)),
        "epochs": len(points),
        "steps": len(step_losses),
    }


# Earlier runs whose epoch count differs from this run's by more than this fraction are not its history.
EPOCHS_TOLERANCE = 0.25


def comparable_runs(
    metrics: Sequence[Mapping[str, Any]], *, model: str, epochs: int, limit: int
) -> list[Mapping[str, Any]]:
    """The recorded train-gate metrics of the ``limit`` most recent earlier runs that are this run's history:
    the same model, and about as many passes over their data (within ``EPOCHS_TOLERANCE``).

    The final training loss depends on how often the model saw each image: with the epoch budget following
    the set's size, a first version of 420 images trains 48 epochs and a 1,050-image one 19, and the smaller
    set's lower final loss is memorisation, not a stability bar the larger one must meet. Records from before
    the epochs were recorded count as comparable (as they did then).
    """
    chosen = []
    for entry in metrics:
        if entry.get("model_name") != model:
            continue
        recorded = entry.get("epochs")
        if isinstance(recorded, bool) or not isinstance(recorded, int):
            recorded = epochs  # not recorded: comparable, as before epochs were
        if abs(recorded - epochs) > EPOCHS_TOLERANCE * max(recorded, epochs):
            continue
        chosen.append(entry)
    return chosen[:limit]


def history_from_metrics(metrics: Sequence[Mapping[str, Any]]) -> list[HistoryRun]:
    """Earlier runs from their recorded train-gate metrics, oldest first as given.

    Runs without a finite final loss or a peak memory (a diverged run, or metrics from before this gate
    existed) are skipped: they describe no stable run to compare with.
    """
    runs = []
    for entry in metrics:
        final, peak = entry.get("final_loss"), entry.get("peak_memory_bytes")
        if isinstance(final, bool) or not isinstance(final, int | float) or not math.isfinite(final):
            continue
        if isinstance(peak, bool) or not isinstance(peak, int | float) or not math.isfinite(peak):
            continue
        runs.append(HistoryRun(final_loss=float(final), peak_memory_bytes=int(peak)))
    return runs


def train_gate(
    result_curve: Sequence[float],
    peak_memory_bytes: int,
    history: Sequence[HistoryRun],
    settings: TrainGateSettings,
    *,
    val_curve: Sequence[float] = (),
    step_losses: Sequence[float] = (),
) -> GateVerdict:
    """Judge one training run.

    Args:
        result_curve: per-epoch mean training loss (``TrainingResult.train_loss_curve``); finiteness and
            the final loss are read from it.
        peak_memory_bytes: the run's peak (``TrainingResult.peak_memory_bytes``).
        history: earlier runs of the same model, oldest first; the last ``settings.history_runs`` count.
        settings: the train-gate group of the platform settings.
        val_curve: per-epoch validation loss; a non-finite value fails "finite loss" too (weights that
            blew up can leave the last training-loss mean finite).
        step_losses: every step's training loss (``TrainingResult.step_losses``); smoothness is read from
            ``smoothed_curve`` of them. Empty: from ``result_curve`` itself (a run recorded before steps were).

    Returns:
        Checks "finite loss" and "loss smoothness", then either "history" (first run, passed) or
        "final loss vs history" and "peak memory vs history"; metrics from ``gate_metrics`` plus the
        history means.
    """
    curve = [float(v) for v in result_curve]
    metrics = gate_metrics(curve, peak_memory_bytes, step_losses)
    checks = _stability_checks(curve, val_curve, metrics, settings)
    recent = list(history)[-settings.history_runs :]
    if not recent:
        checks.append(Check("history", "first run", "-", True, detail="no earlier runs; this run starts the history"))
        return GateVerdict(GATE, tuple(checks), {**metrics, "history_runs": 0})
    history_checks, history_metrics = _history_checks(curve, peak_memory_bytes, recent, settings)
    return GateVerdict(GATE, tuple(checks + history_checks), {**metrics, **history_metrics})


def _stability_checks(
    curve: list[float], val_curve: Sequence[float], metrics: Mapping[str, Any], settings: TrainGateSettings
) -> list[Check]:
    """The checks of the run alone: "finite loss" (both curves), "loss smoothness" and "loss rise" (the
    smoothed curve, from ``gate_metrics``)."""
    bad = sorted(
        {i + 1 for i, v in enumerate(curve) if not math.isfinite(v)}
        | {i + 1 for i, v in enumerate(val_curve) if not math.isfinite(float(v))}
    )
    checks = [
        Check(
            "finite loss",
            len(bad),
            "== 0 non-finite epochs",
            not bad and bool(curve),
            detail=f"non-finite at epoch(s) {bad[:5]}" if bad else ("" if curve else "empty loss curve"),
        ),
    ]
    rough, rise = metrics["roughness"], metrics["loss_rise"]
    rise_passed = isinstance(rise, float) and rise <= settings.max_loss_rise  # inf is shown as the string "inf"
    peak = max(metrics["smoothed_loss_curve"], default=math.nan)
    start = math.nan if metrics["initial_loss"] is None else metrics["initial_loss"]
    checks += [
        Check("loss smoothness", round(rough, 6), f"<= {settings.max_roughness:g}", rough <= settings.max_roughness),
        Check(
            "loss rise",
            rise,
            f"<= {settings.max_loss_rise:g} x the first step's",
            rise_passed,
            detail=f"smoothed peak {peak:.4g}, first step {start:.4g}",
        ),
    ]
    return checks


def _history_checks(
    curve: list[float], peak_memory_bytes: int, recent: list[HistoryRun], settings: TrainGateSettings
) -> tuple[list[Check], dict[str, Any]]:
    """The checks against earlier runs, "final loss vs history" and "peak memory vs history", each against
    the mean of ``recent`` (not empty); and the history metrics."""
    mean_loss = sum(run.final_loss for run in recent) / len(recent)
    mean_peak = sum(run.peak_memory_bytes for run in recent) / len(recent)
    final = curve[-1] if curve else math.nan
    # One-sided: the gate guards against a run that went worse (diverged, or grew its memory), not one that
    # learned more; a larger or cleaner dataset version lowers the final loss well past any 5% band.
    loss_change = _increase(final, mean_loss)
    memory_change = _increase(float(peak_memory_bytes), mean_peak)
    checks = [
        Check(
            "final loss vs history",
            _shown(loss_change),
            f"<= {settings.final_loss_tolerance:g} above",
            loss_change <= settings.final_loss_tolerance,
            detail=f"final loss {final:.4g} vs mean {mean_loss:.4g} of {len(recent)} earlier run(s)",
        ),
        Check(
            "peak memory vs history",
            _shown(memory_change),
            f"<= {settings.memory_tolerance:g} above",
            memory_change <= settings.memory_tolerance,
            detail=f"peak {peak_memory_bytes} bytes vs mean {mean_peak:.0f} of {len(recent)} earlier run(s)",
        ),
    ]
    history_metrics = {"history_runs": len(recent), "history_final_loss": mean_loss, "history_peak_memory": mean_peak}
    return checks, history_metrics


def _increase(value: float, reference: float) -> float:
    """(value - reference) / |reference|: how far above the reference, negative below it; a zero reference
    allows nothing above it. A non-finite value gives NaN, which compares as failed."""
    if not math.isfinite(value):
        return math.nan
    if reference == 0:
        return 0.0 if value <= 0 else math.inf
    return (value - reference) / abs(reference)


def _shown(value: float) -> float | str:
    # Verdicts are stored as JSON, which has no NaN or Infinity: those are named instead.
    return round(value, 6) if math.isfinite(value) else str(value)
