"""Real training on the synthetic PCB dataset, at 32x32 so the whole file runs in about a minute on 2 cores."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from serving.preprocessing import PreprocessSpec
from sluicegate.errors import DatasetError
from sluicegate.settings import TrainGateSettings, TrainingSettings
from tasks.dataset_source import LocalSource
from tasks.model_zoo import build_model
from tasks.sample_data import Corruption, make_sample
from tasks.train_gate import HistoryRun, train_gate
from tasks.training import EpochRecord, load_checkpoint, save_checkpoint, train
from tasks.training_data import load_split

# The spec is a parameter of training; 32x32 is a quarter of the default's pixels and still separates the
# classes (the joints fill the frame).
SPEC = PreprocessSpec(height=32, width=32)
# Tuned for speed on a CPU: 3 narrow stages reach >= 0.9 validation accuracy on 560 images in ~15 of 20 epochs.
FAST = TrainingSettings(
    width=16, blocks=(1, 1, 1), epochs=20, patience=5, batch_size=32, learning_rate=5e-3, device="cpu"
)
TINY = TrainingSettings(width=8, blocks=(1, 1), epochs=2, batch_size=16, device="cpu")

Split = tuple[np.ndarray, np.ndarray]


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Split, Split, tuple[str, ...]]:
    directory = tmp_path_factory.mktemp("pcb") / "v1"
    make_sample(directory, count=800, seed=1)  # 560 train, 120 val, 120 test
    source = LocalSource(directory)
    x_train, y_train, labels = load_split(source, source.manifest(), "train", SPEC, None)
    x_val, y_val, _ = load_split(source, source.manifest(), "val", SPEC, labels)
    return (x_train, y_train), (x_val, y_val), labels


def tiny(splits: tuple[Split, Split, tuple[str, ...]]) -> tuple[Split, Split, tuple[str, ...]]:
    (x_train, y_train), (x_val, y_val), labels = splits
    return (x_train[:64], y_train[:64]), (x_val[:32], y_val[:32]), labels


def accuracy(model: torch.nn.Module, split: Split) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(split[0])).argmax(dim=1).numpy()
    return float((predicted == split[1]).mean())


def test_load_split_preprocesses_with_the_spec(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    (x_train, y_train), (x_val, y_val), labels = splits
    assert labels == ("bridge", "excess", "good", "insufficient")
    assert x_train.shape == (560, 3, 32, 32) and x_train.dtype == np.float32
    assert y_train.dtype == np.int64 and set(y_train.tolist()) == {0, 1, 2, 3}
    assert x_val.shape == (120, 3, 32, 32) and len(y_val) == 120


def test_load_split_skips_unlabelled_and_undecodable_rows(tmp_path: Path) -> None:
    for corruption in (Corruption.MISSING_LABELS, Corruption.UNDECODABLE):
        directory = tmp_path / corruption.value
        summary = make_sample(directory, count=40, seed=2, corrupt=corruption)
        source = LocalSource(directory)
        x, y, _ = load_split(source, source.manifest(), "train", SPEC, None)
        assert 0 < len(x) == len(y) <= summary.splits["train"]
        assert np.isfinite(x).all()


def test_load_split_refuses_labels_the_model_lacks(tmp_path: Path) -> None:
    make_sample(tmp_path / "v", count=40, seed=3)
    source = LocalSource(tmp_path / "v")
    with pytest.raises(DatasetError, match="not among the model's labels"):
        load_split(source, source.manifest(), "val", SPEC, ("good", "bridge"))
    with pytest.raises(DatasetError, match="no rows with split 'holdout'"):
        load_split(source, source.manifest(), "holdout", SPEC, None)


def test_training_reaches_90_percent_validation_accuracy(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    train_split, val_split, labels = splits
    seen: list[EpochRecord] = []
    model, result = train(train_split, val_split, labels, FAST, on_epoch=seen.append)

    assert result.best_val_accuracy >= 0.90, result.history
    # The best epoch's weights were restored: the returned model scores exactly what that epoch did.
    assert not model.training
    assert accuracy(model, val_split) == pytest.approx(result.best_val_accuracy)
    assert result.best_val_loss == min(record.val_loss for record in result.history)
    assert tuple(seen) == result.history
    assert result.train_loss_curve == tuple(record.train_loss for record in result.history)
    # 560 images at batch 32: 18 steps an epoch (the last of 16), each step's loss kept for the train gate.
    assert len(result.step_losses) == 18 * len(result.history)
    first_epoch = result.step_losses[:18]
    assert result.history[0].train_loss == pytest.approx(sum(first_epoch) / 18, rel=1e-6)
    assert result.resolved.arch == "resnet-small" and result.resolved.channels == 3
    assert (result.resolved.epochs, result.resolved.patience, result.resolved.width) == (20, 5, 16)
    assert result.labels == labels and result.device == "cpu" and not result.amp
    assert result.parameters == sum(p.numel() for p in model.parameters())
    assert result.peak_memory_bytes > 0
    assert all(record.images_per_second > 0 for record in result.history)
    # A healthy run passes the train gate as a first run.
    verdict = train_gate(
        result.train_loss_curve, result.peak_memory_bytes, [], TrainGateSettings(), step_losses=result.step_losses
    )
    assert verdict.passed, verdict.reason()


def test_same_seed_gives_identical_weights(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    train_split, val_split, labels = tiny(splits)
    before = torch.get_rng_state()
    first, result_a = train(train_split, val_split, labels, TINY)
    second, result_b = train(train_split, val_split, labels, TINY)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert result_a.train_loss_curve == result_b.train_loss_curve
    assert result_a.step_losses == result_b.step_losses
    # The caller's global state is left as it was.
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.are_deterministic_algorithms_enabled()

    third, _ = train(train_split, val_split, labels, TINY.model_copy(update={"seed": 1}))
    assert not torch.equal(first.state_dict()["head.weight"], third.state_dict()["head.weight"])


def test_peak_memory_follows_the_step_not_the_dataset(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    """The train gate compares peak memory with earlier runs: it must move with what a step holds (model,
    batch size, optimizer), and not with the dataset's size or the process's allocator history."""
    (x_train, y_train), val_split, labels = splits
    small = (x_train[:64], y_train[:64])
    _, first = train(small, val_split, labels, TINY)
    _, larger = train((x_train[:256], y_train[:256]), val_split, labels, TINY)
    assert larger.peak_memory_bytes == first.peak_memory_bytes
    verdict = train_gate(
        larger.train_loss_curve,
        larger.peak_memory_bytes,
        [HistoryRun(final_loss=first.train_loss_curve[-1], peak_memory_bytes=first.peak_memory_bytes)],
        TrainGateSettings(),
    )
    assert [c.name for c in verdict.checks if c.name == "peak memory vs history" and c.passed]

    # At least parameters, gradients and AdamW's two moments, all float32.
    assert first.peak_memory_bytes > 4 * 4 * first.parameters
    # A batch twice as large saves twice the activations; a wider model holds more of everything.
    _, doubled = train(small, val_split, labels, TINY.model_copy(update={"batch_size": 32}))
    _, wider = train(small, val_split, labels, TINY.model_copy(update={"width": 16}))
    assert doubled.peak_memory_bytes > 1.3 * first.peak_memory_bytes
    assert wider.peak_memory_bytes > 1.3 * first.peak_memory_bytes
    refused = train_gate(
        doubled.train_loss_curve,
        doubled.peak_memory_bytes,
        [HistoryRun(final_loss=first.train_loss_curve[-1], peak_memory_bytes=first.peak_memory_bytes)],
        TrainGateSettings(),
    )
    assert "peak memory vs history" in {c.name for c in refused.failed}


def test_absurd_learning_rate_fails_the_train_gate(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    (x_train, y_train), val_split, labels = splits
    settings = TINY.model_copy(update={"learning_rate": 1e3, "epochs": 4, "patience": 10})
    _, result = train((x_train[:128], y_train[:128]), val_split, labels, settings)
    verdict = train_gate(
        result.train_loss_curve, result.peak_memory_bytes, [], TrainGateSettings(), step_losses=result.step_losses
    )
    assert not verdict.passed, result.train_loss_curve
    assert {c.name for c in verdict.failed} & {"finite loss", "loss smoothness", "loss rise"}


def test_checkpoint_round_trip_is_safetensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("resnet-small", 4, in_channels=3, width=8, blocks=(1, 1)).eval()
    path = tmp_path / "model" / "model.safetensors"
    metadata = {"labels": '["bridge","excess","good","insufficient"]', "model_version": "v1.0.0-abc1234-def5678"}

    digest = save_checkpoint(model, path, metadata)

    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    # safetensors: an 8-byte little-endian header length, then exactly that many bytes of JSON naming every
    # tensor. Not torch.save's zip (b"PK") nor a bare pickle; a pickle's b"\x80" opcode cannot be tested for
    # directly, since the length's low byte may itself be 0x80.
    (header_length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_length])
    assert header["__metadata__"] == metadata
    assert set(header) - {"__metadata__"} == set(model.state_dict())
    assert data[:2] != b"PK"
    assert not list(tmp_path.glob("model/*.partial"))

    torch.manual_seed(1)
    fresh = build_model("resnet-small", 4, in_channels=3, width=8, blocks=(1, 1)).eval()
    assert load_checkpoint(fresh, path) == metadata
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    other = build_model("resnet-small", 4, in_channels=3, width=16, blocks=(1, 1))
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_checkpoint(other, path)
    with pytest.raises(TypeError, match="str to str"):
        save_checkpoint(model, tmp_path / "bad.safetensors", {"epochs": 3})  # type: ignore[dict-item]


def test_train_refuses_inputs_it_cannot_take(splits: tuple[Split, Split, tuple[str, ...]]) -> None:
    (x_train, y_train), (x_val, y_val), labels = tiny(splits)
    with pytest.raises(ValueError, match=r"C 1 or 3"):
        train((x_train[:, :2], y_train), (x_val[:, :2], y_val), labels, TINY)
    with pytest.raises(ValueError, match=r"val X must have train's \(C, H, W\)"):
        train((x_train, y_train), (x_val[:, :, :16, :16], y_val), labels, TINY)
