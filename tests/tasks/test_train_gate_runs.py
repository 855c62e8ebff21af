"""The train gate on real training runs: a small grey two-class set (the case that was refused on a
per-epoch curve of a handful of points) passes; learning rates far too high are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from sluicegate.settings import TrainGateSettings, TrainingSettings
from tasks.train_gate import train_gate
from tasks.training import TrainingResult, train

Split = tuple[np.ndarray, np.ndarray]
LABELS = ("3", "8")


@pytest.fixture(scope="module")
def small_grey() -> tuple[Split, Split]:
    """140 training and 40 validation images of 3s and 8s, 25x25 one-channel, normalised: about the size of
    the refused run (140 images, 2 classes, 25x25 grey)."""
    digits = load_digits()
    keep = np.isin(digits.target, (3, 8))
    x = torch.from_numpy(digits.images[keep] / 16).float()[:, None]
    x = torch.nn.functional.interpolate(x, size=(25, 25), mode="bilinear", align_corners=False)
    x_norm = ((x - 0.449) / 0.226).numpy()
    y = (digits.target[keep] == 8).astype(np.int64)
    return (x_norm[:140], y[:140]), (x_norm[140:180], y[140:180])


def judged(result: TrainingResult) -> object:
    return train_gate(
        result.train_loss_curve,
        result.peak_memory_bytes,
        [],
        TrainGateSettings(),
        val_curve=[record.val_loss for record in result.history],
        step_losses=result.step_losses,
    )


def test_a_healthy_small_grey_run_passes(small_grey: tuple[Split, Split]) -> None:
    train_split, val_split = small_grey
    _, result = train(train_split, val_split, LABELS, TrainingSettings(device="cpu"))

    # Unset settings chosen from the data: a small input gets resnet-small; 140 images the most epochs.
    assert result.resolved.arch == "resnet-small" and result.resolved.channels == 1
    assert (result.resolved.epochs, result.resolved.patience) == (60, 15)
    assert len(result.step_losses) == 3 * len(result.history)  # 140 at batch 64: 64, 64, 12
    assert result.best_val_accuracy >= 0.9, result.history
    verdict = judged(result)
    assert verdict.passed, verdict.reason()  # type: ignore[attr-defined]


@pytest.mark.parametrize("learning_rate", [10.0, 50.0])
def test_a_learning_rate_far_too_high_is_refused(small_grey: tuple[Split, Split], learning_rate: float) -> None:
    train_split, val_split = small_grey
    settings = TrainingSettings(device="cpu", learning_rate=learning_rate, epochs=10)
    _, result = train(train_split, val_split, LABELS, settings)

    verdict = judged(result)
    assert not verdict.passed, result.step_losses  # type: ignore[attr-defined]
    failed = {check.name for check in verdict.failed}  # type: ignore[attr-defined]
    assert failed & {"finite loss", "loss rise"}, failed
