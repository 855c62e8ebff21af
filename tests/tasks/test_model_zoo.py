"""Both architectures, grey and colour: build, one training step, any input size, ONNX export with parity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.conversion import export_onnx, parity
from tasks.model_zoo import ARCHITECTURES, build_model, default_shape

# Narrow versions of each: the export and parity are what is tested, not the capacity.
SHAPES = {"resnet-small": (8, (1, 1, 1)), "resnet-wide": (8, (1, 1, 1, 1))}
SIDES = {"resnet-small": 24, "resnet-wide": 64}


def trained_one_step(arch: str, channels: int, side: int) -> torch.nn.Module:
    """A model after one AdamW step, so batch norm holds running statistics other than the initial ones."""
    torch.manual_seed(0)
    width, blocks = SHAPES[arch]
    model = build_model(arch, 3, in_channels=channels, width=width, blocks=blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, channels, side, side) * 2 + 0.5, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    torch.autograd.backward(loss)
    optimizer.step()
    after = torch.nn.functional.cross_entropy(model(x), y)
    assert torch.isfinite(after) and not torch.equal(after, loss)
    return model.eval()


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_exports_to_onnx_with_parity(arch: str, channels: int, tmp_path: Path) -> None:
    side = SIDES[arch]
    model = trained_one_step(arch, channels, side)
    batch = np.random.default_rng(1).standard_normal((6, channels, side, side)).astype(np.float32)

    export_onnx(model, batch[:1], tmp_path / "model.onnx")
    verdict = parity(model, tmp_path / "model.onnx", batch, atol=1e-4)

    assert verdict.passed, verdict.reason()
    assert verdict.metrics["batch_size"] == 6


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_any_input_size_gives_logits(arch: str) -> None:
    width, blocks = SHAPES[arch]
    model = build_model(arch, 5, in_channels=1, width=width, blocks=blocks).eval()
    with torch.no_grad():
        for height, width_px in ((8, 8), (17, 23), (25, 25), (96, 64)):
            assert model(torch.zeros(2, 1, height, width_px)).shape == (2, 5)


def test_default_shapes_and_the_wide_stem() -> None:
    assert ARCHITECTURES == ("resnet-small", "resnet-wide")
    assert default_shape("resnet-small") == (16, (1, 1, 1))
    assert default_shape("resnet-wide") == (32, (2, 2, 2, 2))
    small = build_model("resnet-small", 10, in_channels=1, width=16, blocks=(1, 1, 1))
    wide = build_model("resnet-wide", 10, in_channels=3, width=32, blocks=(2, 2, 2, 2))
    # resnet-small keeps the input's resolution in its first stage; resnet-wide halves it in the stem.
    assert small.stem(torch.zeros(1, 1, 32, 32)).shape == (1, 16, 32, 32)
    assert wide.stem(torch.zeros(1, 3, 64, 64)).shape == (1, 32, 32, 32)
    assert sum(p.numel() for p in small.parameters()) < 100_000 < 1_000_000 < sum(p.numel() for p in wide.parameters())


def test_build_model_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown model architecture 'vgg'.*resnet-small.*resnet-wide"):
        build_model("vgg", 4, in_channels=3, width=8, blocks=(1,))
    with pytest.raises(ValueError, match="in_channels must be >= 1"):
        build_model("resnet-small", 4, in_channels=0, width=8, blocks=(1,))
    with pytest.raises(ValueError, match="blocks must list at least one stage"):
        build_model("resnet-wide", 4, in_channels=1, width=8, blocks=())
    with pytest.raises(ValueError, match="unknown model architecture 'auto'"):
        default_shape("auto")
