"""Gate 3's training run: a residual CNN trained on the train split, scored on val each epoch, and its checkpoints.

The inputs come from ``tasks.training_data.load_split``, made by ``serving.preprocessing.preprocess``, the
code the model server runs, so the model is trained on tensors like those it will be served (one grey
channel or three). Settings left unset are resolved from the data first (``resolve_training``): the
architecture from the input size, the epoch budget from the training-set size. Augmentation
(``tasks.augment``) moves, turns and zooms the normalised tensors a little and mirrors them only when the
settings allow it.

On the CPU a run is deterministic: the same data, settings and seed give bit-identical weights (global RNG
state and the deterministic-algorithms flag are restored afterwards). Checkpoints are safetensors, never
pickle, so loading one cannot run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from sluicegate.errors import ConfigError
from sluicegate.settings import TrainingSettings
from tasks.augment import AugmentPolicy, augment
from tasks.model_zoo import build_model, default_shape

log = logging.getLogger(__name__)

# Validation batches carry no activations for backward, so they can be larger than training ones.
EVAL_BATCH = 256

Split = tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]

# The epoch budget, when unset, is about this many training images seen in all, within the bounds below.
# A fixed number of images seen (rather than of epochs) keeps the run's cost about constant across dataset
# sizes: 1,257 digits get 16 epochs (about a minute on two CPU cores at 32x32), 140 images the maximum of 60
# (a set that small needs many passes for the schedule to settle, and each pass is cheap). The floor of 10
# lets a large set still anneal the learning rate over several passes; early stopping ends a run sooner
# when validation loss stops improving.
IMAGES_SEEN = 20_000
MIN_EPOCHS, MAX_EPOCHS = 10, 60
# resnet-small keeps every pixel of an input below this side; resnet-wide halves larger ones in its stem.
WIDE_FROM = 64


@dataclass(frozen=True)
class ResolvedTraining:
    """The training settings with every "auto" or unset field chosen: what a run actually used."""

    arch: str
    width: int
    blocks: tuple[int, ...]
    epochs: int
    patience: int
    batch_size: int
    learning_rate: float
    weight_decay: float
    augment_shift: float
    augment_rotate_degrees: float
    augment_scale: float
    augment_flips: bool
    augment_quarter_turns: bool
    channels: int

    def params(self) -> dict[str, str | int | float | bool]:
        """Flat parameters for MLflow (``blocks`` as "2,2,2,2": MLflow params are scalars)."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        return {**values, "blocks": ",".join(str(count) for count in self.blocks)}

    def augment_policy(self) -> AugmentPolicy:
        return AugmentPolicy(
            shift=self.augment_shift,
            rotate_degrees=self.augment_rotate_degrees,
            scale=self.augment_scale,
            flips=self.augment_flips,
            quarter_turns=self.augment_quarter_turns,
        )


def resolve_training(
    settings: TrainingSettings, *, channels: int, height: int, width: int, train_count: int
) -> ResolvedTraining:
    """Choose what ``settings`` leaves to the data; set fields are kept as they are.

    Args:
        settings: the training group of the platform settings.
        channels: input channels, 1 or 3.
        height: input height in pixels.
        width: input width in pixels.
        train_count: images in the training split.

    Returns:
        arch "auto": resnet-small below ``WIDE_FROM`` pixels on the shorter side, resnet-wide from there;
        width and blocks: the architecture's; epochs: ``IMAGES_SEEN / train_count`` rounded, within
        [``MIN_EPOCHS``, ``MAX_EPOCHS``]; patience: ``max(4, epochs // 4)``.

    Raises:
        ValueError: ``channels`` is not 1 or 3, or a size or count is not positive.
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 (grey) or 3 (colour), got {channels}")
    if min(height, width, train_count) < 1:
        raise ValueError(f"height, width and train_count must be >= 1, got {height}, {width}, {train_count}")
    arch = settings.arch
    if arch == "auto":
        arch = "resnet-small" if min(height, width) < WIDE_FROM else "resnet-wide"
    default_width, default_blocks = default_shape(arch)
    epochs = settings.epochs or min(MAX_EPOCHS, max(MIN_EPOCHS, round(IMAGES_SEEN / train_count)))
    return ResolvedTraining(
        arch=arch,
        width=settings.width or default_width,
        blocks=tuple(settings.blocks) if settings.blocks else default_blocks,
        epochs=epochs,
        patience=settings.patience or max(4, epochs // 4),
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        augment_shift=settings.augment_shift,
        augment_rotate_degrees=settings.augment_rotate_degrees,
        augment_scale=settings.augment_scale,
        augment_flips=settings.augment_flips,
        augment_quarter_turns=settings.augment_quarter_turns,
        channels=channels,
    )


@dataclass(frozen=True)
class EpochRecord:
    """One epoch. ``seconds`` covers training and validation; ``images_per_second`` the training pass only."""

    epoch: int  # 1-based
    train_loss: float
    val_loss: float
    val_accuracy: float
    seconds: float
    images_per_second: float


@dataclass(frozen=True)
class TrainingResult:
    labels: tuple[str, ...]  # class index -> label
    history: tuple[EpochRecord, ...]
    best_epoch: int
    best_val_loss: float
    best_val_accuracy: float
    peak_memory_bytes: int  # CPU: tensor bytes of the largest step (_PeakMemory); CUDA: max_memory_allocated
    device: str
    amp: bool  # bf16 autocast was actually used (requested and on CUDA)
    parameters: int
    stopped_early: bool  # patience ran out or the loss became non-finite
    train_loss_curve: tuple[float, ...]  # per-epoch mean training loss
    step_losses: tuple[float, ...]  # every training step's batch loss, in order: the train gate's smoothness
    resolved: ResolvedTraining  # the settings the run used, unset ones chosen from the data


def train(
    train: Split,
    val: Split,
    labels: Sequence[str],
    settings: TrainingSettings,
    *,
    on_epoch: Callable[[EpochRecord], None] | None = None,
) -> tuple[nn.Module, TrainingResult]:
    """Train the model ``resolve_training`` chooses with AdamW and a cosine schedule, early-stopping on
    validation loss.

    Args:
        train: ``(X, y)`` from ``load_split``: float32 ``(N, C, H, W)`` with C 1 or 3, int64 labels.
        val: ``(X, y)`` from ``load_split`` with the training labels.
        labels: class index -> label.
        settings: the training group of the platform settings.
        on_epoch: called after every epoch (progress, MLflow metrics).

    Returns:
        The model with the weights of its best validation epoch, in eval mode, on the training device, and
        the run's summary. A non-finite loss stops training without raising; it stays in
        ``train_loss_curve`` and ``step_losses`` for the train gate to fail.

    Raises:
        ValueError: arrays of the wrong shape or dtype, empty splits or labels out of range.
        ConfigError: ``settings.device`` is "cuda" on a machine without CUDA.
    """
    _check_split("train", train, len(labels))
    _check_split("val", val, len(labels))
    if val[0].shape[1:] != train[0].shape[1:]:
        raise ValueError(f"val X must have train's (C, H, W) {train[0].shape[1:]}, got {val[0].shape[1:]}")
    _, channels, height, width = train[0].shape
    resolved = resolve_training(settings, channels=channels, height=height, width=width, train_count=len(train[0]))
    device = _device(settings.device)
    amp = settings.amp and device.type == "cuda"
    # The global RNGs are forked so seeding here does not change what the caller draws afterwards.
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), _deterministic(device.type == "cpu"):
        torch.manual_seed(settings.seed)
        model = build_model(
            resolved.arch, len(labels), in_channels=channels, width=resolved.width, blocks=resolved.blocks
        ).to(device)
        meter = _PeakMemory(device, model)
        run = _Run(resolved, settings.seed, device, amp, meter)
        history, steps, best_state, stopped_early = _fit(model, train, val, run, on_epoch)
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    best = _best(history)
    result = TrainingResult(
        labels=tuple(labels),
        history=tuple(history),
        best_epoch=best.epoch,
        best_val_loss=best.val_loss,
        best_val_accuracy=best.val_accuracy,
        peak_memory_bytes=meter.peak(),
        device=device.type,
        amp=amp,
        parameters=sum(p.numel() for p in model.parameters()),
        stopped_early=stopped_early,
        train_loss_curve=tuple(record.train_loss for record in history),
        step_losses=tuple(steps),
        resolved=resolved,
    )
    return model, result


@dataclass(frozen=True)
class _Run:
    """What every epoch of one run shares."""

    settings: ResolvedTraining
    seed: int
    device: torch.device
    amp: bool
    meter: _PeakMemory


def _fit(
    model: nn.Module,
    train: Split,
    val: Split,
    run: _Run,
    on_epoch: Callable[[EpochRecord], None] | None,
) -> tuple[list[EpochRecord], list[float], dict[str, torch.Tensor] | None, bool]:
    """The epoch loop: (history, step losses, best weights (None: no finite validation loss), stopped early)."""
    settings = run.settings
    x_train, y_train = torch.from_numpy(train[0]), torch.from_numpy(train[1])
    x_val, y_val = torch.from_numpy(val[0]), torch.from_numpy(val[1])
    steps = _steps_per_epoch(len(x_train), settings.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=settings.epochs * steps)
    # A generator of its own (on the CPU, whatever the device) makes data order and augmentation a
    # function of the seed alone.
    generator = torch.Generator().manual_seed(run.seed)
    history: list[EpochRecord] = []
    step_losses: list[float] = []
    best_loss, best_state, waited = math.inf, None, 0
    for epoch in range(1, settings.epochs + 1):
        started = time.perf_counter()
        losses = _train_epoch(model, optimizer, scheduler, x_train, y_train, run, generator)
        train_seconds = time.perf_counter() - started
        step_losses += losses
        train_loss = math.fsum(losses) / len(losses)
        images = min(len(losses) * settings.batch_size, len(x_train))
        val_loss, val_accuracy = _evaluate(model, x_val, y_val, run.device, run.amp)
        record = EpochRecord(
            epoch=epoch,
            train_loss=train_loss,
            val_loss=val_loss,
            val_accuracy=val_accuracy,
            seconds=time.perf_counter() - started,
            images_per_second=images / max(train_seconds, 1e-9),
        )
        history.append(record)
        log.info(
            "epoch %d: train loss %.4f, val loss %.4f, val accuracy %.4f, %.0f images/s",
            epoch,
            train_loss,
            val_loss,
            val_accuracy,
            record.images_per_second,
        )
        if on_epoch is not None:
            on_epoch(record)
        if not math.isfinite(train_loss) or not math.isfinite(val_loss):
            log.warning("epoch %d: non-finite loss (train %s, val %s); training stopped", epoch, train_loss, val_loss)
            return history, step_losses, best_state, True
        if val_loss < best_loss:
            best_loss, waited = val_loss, 0
            best_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        else:
            waited += 1
            if waited >= settings.patience:
                return history, step_losses, best_state, epoch < settings.epochs
    return history, step_losses, best_state, False


def _train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    x: torch.Tensor,
    y: torch.Tensor,
    run: _Run,
    generator: torch.Generator,
) -> list[float]:
    """One pass over the shuffled training set: each step's batch loss (non-finite ones included)."""
    model.train()
    policy = run.settings.augment_policy()
    meter, device = run.meter, run.device
    losses: list[torch.Tensor] = []
    for indices in _batches(len(x), run.settings.batch_size, generator):
        # Augmented on the CPU, where the generator is, before the copy to the device.
        inputs = augment(x[indices], policy, generator).to(device, non_blocking=True)
        targets = y[indices].to(device, non_blocking=True)
        with meter.forward(inputs), torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=run.amp):
            logits: torch.Tensor = model(inputs)
            loss = nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # the functional form: Tensor.backward is untyped in torch 2.13 stubs
        optimizer.step()
        meter.after_step(model, optimizer)
        scheduler.step()
        # Kept on the device and read once per epoch: a per-batch .item() would stall a GPU every step.
        losses.append(loss.detach().float())
    return [float(value) for value in torch.stack(losses).cpu().tolist()]


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    order = torch.randperm(count, generator=generator)
    for start in range(0, _steps_per_epoch(count, batch_size) * batch_size, batch_size):
        yield order[start : start + batch_size]


def _steps_per_epoch(count: int, batch_size: int) -> int:
    # A trailing batch of one image is dropped: batch norm cannot normalise a single sample in training.
    full, rest = divmod(count, batch_size)
    return full + (1 if rest > 1 or (rest == 1 and full == 0) else 0)


@torch.no_grad()
def _evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, amp: bool
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over a split, in eval mode."""
    model.eval()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, len(x), EVAL_BATCH):
        inputs = x[start : start + EVAL_BATCH].to(device, non_blocking=True)
        targets = y[start : start + EVAL_BATCH].to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=amp):
            logits: torch.Tensor = model(inputs)
        loss += nn.functional.cross_entropy(logits.float(), targets, reduction="sum").double()
        correct += (logits.argmax(dim=1) == targets).sum()
    return float(loss.item()) / len(x), int(correct.item()) / len(x)


def _best(history: Sequence[EpochRecord]) -> EpochRecord:
    """The epoch with the lowest finite validation loss; the last one when none is finite."""
    finite = [record for record in history if math.isfinite(record.val_loss)]
    return min(finite, key=lambda record: record.val_loss) if finite else history[-1]


def _check_split(name: str, split: Split, classes: int) -> None:
    x, y = split
    if x.ndim != 4 or x.shape[1] not in (1, 3) or x.dtype != np.float32:
        raise ValueError(f"{name} X must be float32 (N, C, H, W), C 1 or 3, from load_split, got {x.dtype} {x.shape}")
    if y.shape != (len(x),) or y.dtype != np.int64:
        raise ValueError(f"{name} y must be int64 of shape ({len(x)},), got {y.dtype} {y.shape}")
    if len(x) == 0:
        raise ValueError(f"{name} split is empty; training needs at least one image in it")
    if y.min() < 0 or y.max() >= classes:
        raise ValueError(f"{name} y must index the {classes} labels, got values {y.min()}..{y.max()}")


def _device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise ConfigError("SLUICEGATE_TRAINING__DEVICE is 'cuda' but CUDA is not available; set it to 'auto' or 'cpu'")
    return torch.device("cuda", torch.cuda.current_device()) if available else torch.device("cpu")


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    """Deterministic kernels while training, the caller's setting afterwards.

    Only on the CPU: on CUDA deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA starts,
    which is the process's business, not a training function's.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=warn_only)


class _PeakMemory:
    """Peak memory of a training step. CUDA: the caching allocator's own peak. CPU: counted from the tensors
    themselves: parameters, gradients and optimizer state, plus the largest batch with the activations
    autograd saved for backward. Both depend only on the model, the batch size and the optimizer, so the
    train gate's comparison with earlier runs sees a change of those and not noise. (Resident memory growth,
    which this sampled before, moved by 17% between two runs of one configuration in one worker process:
    allocator caches and other threads' allocations are in it, and a larger dataset version in the process.)
    """

    def __init__(self, device: torch.device, model: nn.Module) -> None:
        self.device = device
        self._max = 0
        self._saved = 0
        self._seen: set[int] = set()
        # Optimizer steps update parameters in place, so their storages stay put for the whole run.
        self._static = {tensor.untyped_storage().data_ptr() for tensor in (*model.parameters(), *model.buffers())}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def forward(self, inputs: torch.Tensor) -> Iterator[None]:
        """Around one training forward pass: counts the storages autograd keeps for backward (each once:
        a ReLU output saved by two ops is one buffer), leaving out parameters, which are counted as state."""
        if self.device.type == "cuda":
            yield
            return
        self._saved, self._seen = _storage_bytes(inputs), {inputs.untyped_storage().data_ptr()}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self._seen and pointer not in self._static:
                self._seen.add(pointer)
                self._saved += _storage_bytes(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()``: the state now includes gradients and the optimizer's moments."""
        if self.device.type == "cuda":
            return
        state = [*model.parameters(), *model.buffers()]
        state += [p.grad for p in model.parameters() if p.grad is not None]
        state += [value for entry in optimizer.state.values() for value in entry.values() if torch.is_tensor(value)]
        pointers = {tensor.untyped_storage().data_ptr(): _storage_bytes(tensor) for tensor in state}
        self._static = set(pointers)
        self._max = max(self._max, sum(pointers.values()) + self._saved)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._max


def _storage_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


def save_checkpoint(model: nn.Module, path: Path, metadata: Mapping[str, str]) -> str:
    """Write the model's state dict as safetensors (no pickle: loading cannot run code).

    The file is written next to ``path`` and renamed into place, so a reader never sees half of one.

    Returns:
        The sha256 of the file written.

    Raises:
        TypeError: a metadata key or value is not a string (safetensors stores only strings).
    """
    from safetensors.torch import save_file

    bad = {key: value for key, value in metadata.items() if not isinstance(key, str) or not isinstance(value, str)}
    if bad:
        raise TypeError(f"checkpoint metadata must map str to str; convert these entries first: {bad!r}")
    # Copies on the CPU, contiguous and unshared: what safetensors requires of every tensor.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=dict(metadata))
    partial.replace(path)
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_checkpoint(model: nn.Module, path: Path) -> dict[str, str]:
    """Load a ``save_checkpoint`` file into ``model`` (strict: every tensor must match); returns its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    model.load_state_dict(load_file(str(path)), strict=True)
    return metadata
