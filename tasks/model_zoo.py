"""The model architectures training can build, chosen by name from a closed set.

Every model takes the output of ``serving.preprocessing.preprocess`` (float32 NCHW) and returns logits.
Forward passes have no data-dependent control flow, so ``torch.onnx.export`` traces them to one static
graph (the convert gate compares that graph with the PyTorch model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

ARCHITECTURES: tuple[str, ...] = ("resnet-small",)


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


class ResNetSmall(nn.Module):
    """Stem conv-bn-relu, stages of ``BasicBlock`` (stride 2 between stages, channels ``width * 2**stage``),
    global average pool, linear classifier."""

    def __init__(self, num_classes: int, width: int, blocks: Sequence[int]) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
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


def _resnet_small(num_classes: int, width: int, blocks: Sequence[int]) -> nn.Module:
    return ResNetSmall(num_classes, width, blocks)


_BUILDERS: dict[str, Callable[[int, int, Sequence[int]], nn.Module]] = {"resnet-small": _resnet_small}


def build_model(arch: str, num_classes: int, *, width: int, blocks: Sequence[int]) -> nn.Module:
    """A freshly initialised model (initialisation draws from torch's global RNG: seed it first).

    Args:
        arch: one of ``ARCHITECTURES``.
        num_classes: size of the logits.
        width: channels of the first stage.
        blocks: residual blocks per stage; one stage per entry.

    Returns:
        The model, in training mode, on the CPU.

    Raises:
        ValueError: an unknown ``arch``, or a non-positive ``num_classes``, ``width`` or block count.
    """
    builder = _BUILDERS.get(arch)
    if builder is None:
        raise ValueError(f"unknown model architecture {arch!r}; choose one of {list(ARCHITECTURES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not blocks or any(count < 1 for count in blocks):
        raise ValueError(f"blocks must list at least one stage, each with >= 1 block, got {list(blocks)}")
    return builder(num_classes, width, tuple(blocks))
