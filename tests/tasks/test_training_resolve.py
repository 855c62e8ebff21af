"""resolve_training: what a run uses when the settings leave a field unset."""

from __future__ import annotations

import pytest

from sluicegate.settings import TrainingSettings
from tasks.training import MAX_EPOCHS, MIN_EPOCHS, resolve_training

DEFAULT = TrainingSettings()


def test_architecture_follows_the_shorter_side() -> None:
    small = resolve_training(DEFAULT, channels=1, height=32, width=32, train_count=1000)
    assert (small.arch, small.width, small.blocks, small.channels) == ("resnet-small", 16, (1, 1, 1), 1)
    wide = resolve_training(DEFAULT, channels=3, height=64, width=96, train_count=1000)
    assert (wide.arch, wide.width, wide.blocks, wide.channels) == ("resnet-wide", 32, (2, 2, 2, 2), 3)
    assert resolve_training(DEFAULT, channels=3, height=63, width=500, train_count=1000).arch == "resnet-small"


def test_epochs_from_the_training_set_size() -> None:
    def epochs(count: int) -> int:
        return resolve_training(DEFAULT, channels=1, height=32, width=32, train_count=count).epochs

    assert epochs(1257) == 16  # the digits' train split: about 20,000 images seen
    assert epochs(140) == MAX_EPOCHS == 60
    assert epochs(100_000) == MIN_EPOCHS == 10
    counts = [50, 140, 400, 1000, 2000, 5000]
    assert [epochs(c) for c in counts] == sorted((epochs(c) for c in counts), reverse=True)


def test_patience_follows_epochs_with_a_floor() -> None:
    for count, patience in ((140, 15), (1257, 4), (100_000, 4)):
        assert resolve_training(DEFAULT, channels=1, height=32, width=32, train_count=count).patience == patience


def test_set_fields_are_kept() -> None:
    settings = TrainingSettings(
        arch="resnet-wide", width=8, blocks=(1, 1), epochs=3, patience=2, augment_flips=True, learning_rate=1e-3
    )
    resolved = resolve_training(settings, channels=3, height=24, width=24, train_count=10)
    assert (resolved.arch, resolved.width, resolved.blocks) == ("resnet-wide", 8, (1, 1))
    assert (resolved.epochs, resolved.patience, resolved.learning_rate) == (3, 2, 1e-3)
    assert resolved.augment_policy().flips and not resolved.augment_policy().quarter_turns
    # An explicit patience longer than the epochs is the caller's choice, not corrected.
    assert (
        resolve_training(
            settings.model_copy(update={"patience": 9}), channels=1, height=8, width=8, train_count=5
        ).patience
        == 9
    )


def test_params_are_flat_scalars_for_mlflow() -> None:
    params = resolve_training(DEFAULT, channels=1, height=25, width=25, train_count=140).params()
    assert params["blocks"] == "1,1,1" and params["arch"] == "resnet-small" and params["epochs"] == 60
    assert all(isinstance(value, str | int | float | bool) for value in params.values())
    assert {"augment_shift", "augment_rotate_degrees", "augment_scale", "augment_flips", "channels"} <= set(params)


def test_refuses_what_no_model_takes() -> None:
    with pytest.raises(ValueError, match=r"channels must be 1 \(grey\) or 3"):
        resolve_training(DEFAULT, channels=4, height=32, width=32, train_count=10)
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve_training(DEFAULT, channels=3, height=32, width=32, train_count=0)
