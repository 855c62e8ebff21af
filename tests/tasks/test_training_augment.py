"""Training-time augmentation (tasks/augment.py) on hand-made images whose orientation can be read back."""

from __future__ import annotations

import pytest
import torch

from tasks.augment import AugmentPolicy, augment

SIDE = 24
NONE = AugmentPolicy(shift=0, rotate_degrees=0, scale=0)  # no resampling: only the exact symmetries


def ramp(count: int = 256, *, height: int = SIDE, width: int = SIDE, vertical: bool = False) -> torch.Tensor:
    """Images that are dark on the left (top) and bright on the right (bottom): a mirror image reverses it."""
    line = torch.linspace(-1, 1, height if vertical else width)
    image = line[:, None].expand(height, width) if vertical else line[None, :].expand(height, width)
    return image.reshape(1, 1, height, width).repeat(count, 1, 1, 1).contiguous()


def corner(count: int = 64, *, height: int = SIDE, width: int = SIDE) -> torch.Tensor:
    """An asymmetric image: one bright 3x5 patch near the top-left corner; every turn and flip differs."""
    x = torch.zeros(count, 1, height, width)
    x[:, :, 2:5, 3:8] = 1.0
    return x


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def centroids(x: torch.Tensor) -> torch.Tensor:
    """(N, 2) row and column centre of mass of non-negative images."""
    weights = x.sum(dim=1)
    rows = torch.arange(x.shape[2], dtype=x.dtype)[None, :, None]
    cols = torch.arange(x.shape[3], dtype=x.dtype)[None, None, :]
    total = weights.sum(dim=(1, 2))
    return torch.stack(((weights * rows).sum(dim=(1, 2)) / total, (weights * cols).sum(dim=(1, 2)) / total), dim=1)


def test_shape_kept_input_untouched_and_a_function_of_the_seed() -> None:
    x = torch.randn(32, 3, 20, 28)
    before = x.clone()
    policy = AugmentPolicy(flips=True, quarter_turns=True)
    first = augment(x, policy, seeded(1))
    assert first.shape == x.shape and first.dtype == torch.float32
    assert torch.equal(x, before)
    assert torch.equal(first, augment(x, policy, seeded(1)))
    assert not torch.equal(first, augment(x, policy, seeded(2)))
    # Every image gets its own draw: two copies of one image in a batch come out differently.
    twins = augment(torch.randn(1, 1, SIDE, SIDE).repeat(2, 1, 1, 1), AugmentPolicy(), seeded(0))
    assert not torch.equal(twins[0], twins[1])


def test_the_default_policy_never_mirrors() -> None:
    """A 6 turned over is a 9: with flips off, the dark side of every image stays where it was."""
    for vertical in (False, True):
        x = ramp(vertical=vertical)
        out = augment(x, AugmentPolicy(), seeded(0))
        agreement = (out * x).mean(dim=(1, 2, 3))
        assert (agreement > 0.2).all(), agreement.min()
        assert not torch.equal(out, x)  # it did move them

        mirrored = augment(x, AugmentPolicy(flips=True), seeded(0))
        agreement = (mirrored * x).mean(dim=(1, 2, 3))
        assert 0.3 < (agreement < -0.2).float().mean() < 0.7  # about half the images mirrored on each axis


def test_flips_and_turns_are_exact_and_only_when_asked() -> None:
    x = corner()
    assert torch.equal(augment(x, NONE, seeded(0)), x)

    flipped = augment(x, AugmentPolicy(shift=0, rotate_degrees=0, scale=0, flips=True), seeded(0))
    flips = [x[0], x[0].flip(2), x[0].flip(1), x[0].flip(1).flip(2)]  # none, h, v, both (per image: C, H, W)
    seen = {next(i for i, f in enumerate(flips) if torch.equal(image, f)) for image in flipped}
    assert seen == {0, 1, 2, 3}

    turned = augment(x, AugmentPolicy(shift=0, rotate_degrees=0, scale=0, quarter_turns=True), seeded(0))
    turns = [torch.rot90(x[0], k, dims=(1, 2)) for k in range(4)]
    seen = {next(k for k, t in enumerate(turns) if torch.equal(image, t)) for image in turned}
    assert seen == {0, 1, 2, 3}


def test_quarter_turns_keep_a_non_square_image_its_shape() -> None:
    x = corner(height=16, width=24)
    turned = augment(x, AugmentPolicy(shift=0, rotate_degrees=0, scale=0, quarter_turns=True), seeded(0))
    assert turned.shape == x.shape
    upright, upside_down = x[0], torch.rot90(x[0], 2, dims=(1, 2))
    outcomes = [torch.equal(image, upright) or torch.equal(image, upside_down) for image in turned]
    assert all(outcomes)
    assert any(torch.equal(image, upside_down) for image in turned)


def test_shift_moves_images_within_the_bound() -> None:
    x = torch.zeros(256, 1, SIDE, SIDE)
    x[:, :, 10:14, 10:14] = 1.0  # a blob at the centre, far from the edges
    out = augment(x, AugmentPolicy(shift=0.1, rotate_degrees=0, scale=0), seeded(0))
    moved = (centroids(out) - centroids(x)).abs()
    assert moved.max() <= 0.1 * SIDE + 0.05
    assert (moved > 0.05 * SIDE).any(dim=1).float().mean() > 0.5


def test_rotation_and_zoom_keep_the_centre_and_change_the_size_within_the_bound() -> None:
    x = torch.zeros(256, 1, SIDE, SIDE)
    x[:, :, 8:16, 8:16] = 1.0  # centred on the image's centre
    out = augment(x, AugmentPolicy(shift=0, rotate_degrees=10, scale=0.2), seeded(0))
    assert (centroids(out) - centroids(x)).abs().max() < 0.05
    # Zoom z scales the area by z**2: within (0.8**2, 1.2**2), and both shrunk and grown images occur.
    area = out.sum(dim=(1, 2, 3)) / x[0].sum()
    assert area.min() > 0.8**2 - 0.02 and area.max() < 1.2**2 + 0.02
    assert area.min() < 0.85 and area.max() > 1.15


def test_border_padding_continues_the_background() -> None:
    """Normalised inputs: 0 is the mean colour. A uniform background (here the digits' black after
    normalisation) stays uniform where the shift brings in pixels from outside the frame."""
    black = (0.0 - 0.449) / 0.226
    x = torch.full((64, 1, SIDE, SIDE), black)
    out = augment(x, AugmentPolicy(shift=0.3, rotate_degrees=30, scale=0.3), seeded(0))
    assert torch.allclose(out, x, atol=1e-5)


def test_policy_rejects_out_of_range_values() -> None:
    with pytest.raises(ValueError, match="shift must be in"):
        AugmentPolicy(shift=0.6)
    with pytest.raises(ValueError, match="scale must be in"):
        AugmentPolicy(scale=1.0)
    with pytest.raises(ValueError, match="rotate_degrees"):
        AugmentPolicy(rotate_degrees=-1)


def test_rotation_is_a_rotation_on_a_non_square_image() -> None:
    """The grid's normalised axes differ in pixel length when height != width; the turn must be measured in
    pixels: a horizontal bar comes out at an angle within +-10 degrees that reaches nearly 10."""
    height, width = 24, 72
    x = torch.zeros(256, 1, height, width)
    x[:, :, 11:13, 16:56] = 1.0
    out = augment(x, AugmentPolicy(shift=0, rotate_degrees=10, scale=0), seeded(0))
    weights = out[:, 0]
    rows = torch.arange(height, dtype=torch.float32)[None, :, None]
    cols = torch.arange(width, dtype=torch.float32)[None, None, :]
    total = weights.sum(dim=(1, 2))
    centre_r = (weights * rows).sum(dim=(1, 2)) / total
    centre_c = (weights * cols).sum(dim=(1, 2)) / total
    dr, dc = rows - centre_r[:, None, None], cols - centre_c[:, None, None]
    cov_rc = (weights * dr * dc).sum(dim=(1, 2)) / total
    cov_rr = (weights * dr * dr).sum(dim=(1, 2)) / total
    cov_cc = (weights * dc * dc).sum(dim=(1, 2)) / total
    angles = torch.rad2deg(0.5 * torch.atan2(2 * cov_rc, cov_cc - cov_rr)).abs()
    assert angles.max() < 10.5 and angles.max() > 8.5, angles.max()
