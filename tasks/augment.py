"""Training-time augmentation: a random affine per image, then the symmetries the labels allow.

Written in plain torch (``affine_grid``/``grid_sample``), not torchvision: PyPI's torchvision 0.28.0 is a
CUDA build whose C extension needs libc10_cuda.so, and with the CPU torch 2.13.0 wheel ``import
torchvision`` fails with "RuntimeError: operator torchvision::nms does not exist" (checked 2026-12-03).

The input is the normalised batch from ``tasks.training_data.load_split``. Bilinear weights sum to one, so
resampling commutes with the per-channel normalisation: augmenting the normalised tensor is normalising an
augmented image. In that tensor 0 is the mean colour, not black. Areas the affine moves in from outside the
frame repeat the edge pixels (``padding_mode="border"``): the edges of a preprocessed image are its
background, so the background simply continues, whereas zero padding would paint a band of mean grey that no
served image has (on the digits, a grey frame around a black background). Every draw comes from the caller's
CPU ``torch.Generator``, so a run is a function of its seed. The default policy keeps orientation: flips and
quarter turns are off unless the settings say a turned or mirrored image keeps its label (a 6 turned over is
a 9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class AugmentPolicy:
    """What ``augment`` may do to an image; each magnitude 0 turns its transform off."""

    shift: float = 0.1  # largest translation, as a fraction of the side, each axis
    rotate_degrees: float = 10.0  # rotation drawn from +- this
    scale: float = 0.1  # zoom drawn from 1 +- this
    flips: bool = False  # horizontal and vertical flips, each with probability 1/2
    quarter_turns: bool = False  # 0, 90, 180 or 270 degrees (square inputs; 0 or 180 otherwise)

    def __post_init__(self) -> None:
        if not 0 <= self.shift <= 0.5:
            raise ValueError(f"AugmentPolicy.shift must be in [0, 0.5] (a fraction of the side), got {self.shift}")
        if not 0 <= self.rotate_degrees <= 180:
            raise ValueError(f"AugmentPolicy.rotate_degrees must be in [0, 180], got {self.rotate_degrees}")
        if not 0 <= self.scale < 1:
            raise ValueError(f"AugmentPolicy.scale must be in [0, 1) (zoom 1 +- scale), got {self.scale}")

    @property
    def affine(self) -> bool:
        """Whether the policy moves pixels by anything but the exact symmetries (and so resamples)."""
        return self.shift > 0 or self.rotate_degrees > 0 or self.scale > 0


def augment(x: torch.Tensor, policy: AugmentPolicy, generator: torch.Generator) -> torch.Tensor:
    """A randomly transformed copy of each image of ``x``, labels unchanged.

    Args:
        x: float32 ``(N, C, H, W)`` on the CPU, normalised.
        policy: the transforms allowed and their ranges.
        generator: a CPU generator; the draws are a function of its state.

    Returns:
        A new tensor of ``x``'s shape and dtype (``x`` itself is not modified).
    """
    out = _random_affine(x, policy, generator) if policy.affine else x.clone()
    if policy.flips:
        out = _where(_coin(len(x), generator), out.flip(3), out)
        out = _where(_coin(len(x), generator), out.flip(2), out)
    if policy.quarter_turns:
        out = _random_turns(out, generator)
    return out


def _random_affine(x: torch.Tensor, policy: AugmentPolicy, generator: torch.Generator) -> torch.Tensor:
    """Rotation, zoom and translation per image, bilinear, in one ``grid_sample`` for the whole batch."""
    n = len(x)
    # One draw per parameter per image, in one call: uniform in [-1, 1).
    u = torch.rand((n, 4), generator=generator, dtype=torch.float32) * 2 - 1
    angle = u[:, 0] * math.radians(policy.rotate_degrees)
    zoom = 1 + u[:, 1] * policy.scale
    # The grid is in normalised coordinates, where the side spans 2: a shift of f sides is 2 f.
    shift = u[:, 2:] * (2 * policy.shift)
    # theta maps output coordinates to where they are sampled in the input, so it is the inverse of the
    # transform applied to the picture: a picture zoomed by z is sampled at 1/z, turned by a at -a.
    # The normalised axes have different pixel lengths on a non-square image: the off-diagonal terms carry
    # the aspect ratio so that a rotation stays a rotation, not a shear.
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    aspect = x.shape[2] / x.shape[3]  # height / width
    theta = torch.stack(
        (
            torch.stack((cos, sin * aspect, shift[:, 0]), dim=1),
            torch.stack((-sin / aspect, cos, shift[:, 1]), dim=1),
        ),
        dim=1,
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _random_turns(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each image turned by a random multiple of 90 degrees; only 0 or 180 when it is not square (a
    quarter turn would swap its height and width)."""
    square = x.shape[2] == x.shape[3]
    turns = torch.randint(0, 4, (len(x),), generator=generator)
    if not square:
        turns = turns - turns % 2  # 0 and 2 quarter turns only, still one draw per image
    out = x
    for k in (1, 2, 3) if square else (2,):
        out = _where(turns == k, torch.rot90(x, k, dims=(2, 3)), out)
    return out


def _coin(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand((n,), generator=generator) < 0.5


def _where(mask: torch.Tensor, picked: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per image: ``picked`` where ``mask``, else ``other``."""
    return torch.where(mask[:, None, None, None], picked, other)
