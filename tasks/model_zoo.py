"""The model architectures training can build, chosen by name from a closed set.

Every model takes the output of ``serving.preprocessing.preprocess`` (float32 NCHW, one grey channel or three)
and returns logits, at any input height and width.
Forward passes have no data-dependent control flow, so ``torch.onnx.export`` traces them to one static
graph (the convert gate compares that graph with the PyTorch model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-bn layers with an identity (or 1x1 projection) shortcut, as in ResNet-18/34."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        # Zero-initialised last BN: each block starts as the identity, which lets a deep stack train
        # from the first step with a large learning rate (Goyal et al., "Accurate, Large Minibatch SGD").
        nn.init.zeros_(self.bn2.weight)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem conv-bn-relu, stages of ``BasicBlock`` (stride 2 between stages, channels ``width * 2**stage``),
    global average pool, linear classifier. A stride-2 stem halves the feature maps before the first stage:
    the work of larger inputs, where a stride-1 stem would spend most of it on the first stage."""

    def __init__(
        self, num_classes: int, *, in_channels: int, width: int, blocks: Sequence[int], stem_stride: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=stem_stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        channels = width
        for stage, count in enumerate(blocks):
            out_channels = width * 2**stage
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features: torch.Tensor = self.stages(self.stem(x))
        # A mean over fixed axes (ONNX ReduceMean), not adaptive pooling, keeps any input size exportable.
        logits: torch.Tensor = self.head(features.mean(dim=(2, 3)))
        return logits


@dataclass(frozen=True)
class _Architecture:
    stem_stride: int
    width: int  # the defaults ``resolve_training`` takes when the settings leave them unset
    blocks: tuple[int, ...]


# resnet-small: for inputs under 64 pixels a side. A stride-1 stem keeps every pixel of a 25x25 or 32x32
# image for the first stage; three narrow stages (about 75k parameters at width 16) train in about a minute
# on two CPU cores. resnet-wide: for 64 pixels and more, ResNet-18's four stages of two blocks at half its
# width (about 2.8M parameters at width 32) behind a stride-2 stem, so a 64x64 input costs the first stage
# what a 32x32 one costs resnet-small's.
_ARCHITECTURES: dict[str, _Architecture] = {
    "resnet-small": _Architecture(stem_stride=1, width=16, blocks=(1, 1, 1)),
    "resnet-wide": _Architecture(stem_stride=2, width=32, blocks=(2, 2, 2, 2)),
}
ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)


def default_shape(arch: str) -> tuple[int, tuple[int, ...]]:
    """``(width, blocks)`` of ``arch`` when the settings leave them unset.

    Raises:
        ValueError: an unknown ``arch``.
    """
    found = _architecture(arch)
    return found.width, found.blocks


def build_model(arch: str, num_classes: int, *, in_channels: int, width: int, blocks: Sequence[int]) -> nn.Module:
    """A freshly initialised model (initialisation draws from torch's global RNG: seed it first).

    Args:
        arch: one of ``ARCHITECTURES``.
        num_classes: size of the logits.
        in_channels: channels of the input, 1 (grey, preprocessing colour "L") or 3.
        width: channels of the first stage.
        blocks: residual blocks per stage; one stage per entry.

    Returns:
        The model, in training mode, on the CPU. It accepts any input height and width.

    Raises:
        ValueError: an unknown ``arch``, or a non-positive ``num_classes``, ``in_channels``, ``width`` or
            block count.
    """
    found = _architecture(arch)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1 (1 for grey, 3 for colour), got {in_channels}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not blocks or any(count < 1 for count in blocks):
        raise ValueError(f"blocks must list at least one stage, each with >= 1 block, got {list(blocks)}")
    return ResNet(
        num_classes, in_channels=in_channels, width=width, blocks=tuple(blocks), stem_stride=found.stem_stride
    )


def _architecture(arch: str) -> _Architecture:
    found = _ARCHITECTURES.get(arch)
    if found is None:
        raise ValueError(f"unknown model architecture {arch!r}; choose one of {list(ARCHITECTURES)}")
    return found
