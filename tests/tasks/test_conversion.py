"""The convert gate on real models: dynamo ONNX export, ONNX Runtime parity, TensorRT where a GPU is.

Uses only tmp_path fixtures and imports only numpy/torch/onnx/onnxruntime and tasks.conversion, so the
GPU check runs it with ``--noconftest`` on a machine without the platform's other dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from sluicegate.ids import sha256_file
from tasks.conversion import (
    EngineOutcome,
    build_tensorrt_engine,
    export_onnx,
    parity,
    tensorrt_available,
)

ATOL = 1e-4
HW = 32


class TinyNet(nn.Module):
    """Conv -> BatchNorm -> ReLU, a residual block, global pooling, a linear head."""

    def __init__(self, classes: int = 3, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(width)
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.head = nn.Linear(width, classes)

    def features(self, x: torch.Tensor, *, normalise: bool = True) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(self.norm(y) if normalise else y)
        y = torch.relu(y + self.block(y))  # residual add
        return y.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class WithoutNorm(nn.Module):
    """A wrong export: the same weights, but the first BatchNorm is dropped."""

    def __init__(self, inner: TinyNet) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.head(self.inner.features(x, normalise=False))


def trained_tiny_net(seed: int = 0) -> TinyNet:
    """A TinyNet with non-trivial BatchNorm statistics, in eval mode."""
    torch.manual_seed(seed)
    model = TinyNet()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 3, HW, HW) * 2 + 0.5)
    return model.eval()


def images(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, HW, HW)).astype(np.float32)


@pytest.fixture(scope="module")
def model() -> TinyNet:
    return trained_tiny_net()


@pytest.fixture(scope="module")
def exported(model: TinyNet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("export") / "model.onnx"
    return path, export_onnx(model, images(4), path)


def test_export_is_one_checked_file_with_a_dynamic_batch(exported: tuple[Path, str]) -> None:
    path, digest = exported
    assert [p.name for p in path.parent.iterdir()] == ["model.onnx"]  # no external data, no partial left
    assert digest == sha256_file(path)
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [18]
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, HW, HW]


def test_parity_passes_for_a_faithful_export(model: TinyNet, exported: tuple[Path, str]) -> None:
    verdict = parity(model, exported[0], images(12), atol=ATOL)
    assert verdict.gate == "convert"
    assert verdict.passed, verdict.reason()
    assert [c.name for c in verdict.checks] == ["onnx parity", "dynamic batch"]
    assert verdict.metrics["max_abs_diff"] < ATOL
    assert verdict.metrics["mean_abs_diff"] <= verdict.metrics["max_abs_diff"]
    assert verdict.metrics["providers"] == ["CPUExecutionProvider"]
    assert verdict.metrics["opset"] == 18
    assert verdict.metrics["batch_size"] == 12


def test_the_session_runs_any_batch_size(model: TinyNet, exported: tuple[Path, str]) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(exported[0]), providers=["CPUExecutionProvider"])
    for n in (1, 5, 17):
        batch = images(n, seed=n)
        (logits,) = session.run(None, {"input": batch})
        with torch.no_grad():
            expected = model(torch.from_numpy(batch)).numpy()
        assert logits.shape == (n, 3)
        np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)
    # a one-item parity batch still exercises two batch sizes
    check = parity(model, exported[0], images(1), atol=ATOL).checks[1]
    assert check.passed and set(check.observed) == {1, 2}


def test_a_wrong_export_fails_parity_with_the_observed_difference(model: TinyNet, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.onnx"
    export_onnx(WithoutNorm(model), images(4), wrong)
    verdict = parity(model, wrong, images(8), atol=ATOL)
    assert not verdict.passed
    (failed,) = verdict.failed
    assert failed.name == "onnx parity"
    assert failed.observed > 10 * ATOL
    assert failed.observed == verdict.metrics["max_abs_diff"]
    assert "worst element" in failed.detail
    assert verdict.reason().startswith("convert gate failed: onnx parity observed")
    assert verdict.checks[1].passed  # the wrong model still has a dynamic batch
    assert not model.training  # exporting the wrapper left the shared model in eval mode


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the exporter's own pytree deprecation
def test_a_fixed_batch_export_fails_the_dynamic_batch_check(model: TinyNet, tmp_path: Path) -> None:
    fixed = tmp_path / "fixed.onnx"
    torch.onnx.export(model, (torch.from_numpy(images(4)),), str(fixed), dynamo=True, opset_version=18, verbose=False)
    verdict = parity(model, fixed, images(4), atol=ATOL)
    by_name = {c.name: c for c in verdict.checks}
    assert by_name["onnx parity"].passed
    assert not by_name["dynamic batch"].passed
    assert "batch 1" in by_name["dynamic batch"].detail


def test_export_uses_eval_mode_and_restores_training(tmp_path: Path) -> None:
    model = trained_tiny_net(seed=3).train()
    model.norm.eval()  # a frozen layer inside a training model keeps its own flag
    path = tmp_path / "model.onnx"
    export_onnx(model, images(2), path, input_name="images", output_name="scores")
    assert model.training and not model.norm.training  # restored, layer by layer
    verdict = parity(model, path, images(6), atol=ATOL)  # parity compares with eval-mode PyTorch
    assert verdict.passed, verdict.reason()
    assert model.training
    assert [i.name for i in onnx.load(str(path)).graph.input] == ["images"]


def test_tensorrt_is_reported_missing_here() -> None:
    available, reason = tensorrt_available()
    if available:
        pytest.skip(f"this machine has a GPU and TensorRT ({reason})")
    assert "GPU" in reason or "TensorRT" in reason


def test_engine_build_without_tensorrt_says_why(exported: tuple[Path, str], tmp_path: Path) -> None:
    available, reason = tensorrt_available()
    if available:
        pytest.skip(f"this machine has a GPU and TensorRT ({reason})")
    outcome = build_tensorrt_engine(
        exported[0], tmp_path / "model.plan", profile=(1, 8, 64), fp16=False, cache_dir=tmp_path / "cache"
    )
    assert outcome == EngineOutcome(False, None, reason, False, "fp32", None, None)
    assert not (tmp_path / "model.plan").exists()


def test_engine_profile_is_checked(exported: tuple[Path, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min <= opt <= max"):
        build_tensorrt_engine(exported[0], tmp_path / "m.plan", profile=(8, 1, 64), fp16=False, cache_dir=tmp_path)


# -------------------------------------------------------------------------------------------- GPU only


def _export_for_engine(model: nn.Module, path: Path) -> None:
    """The dynamo exporter needs onnxscript; a GPU machine without it still tests TensorRT (legacy export)."""
    if importlib.util.find_spec("onnxscript") is not None:
        export_onnx(model, images(4), path)
        return
    torch.onnx.export(
        model.eval(),
        (torch.from_numpy(images(4)),),
        str(path),
        dynamo=False,
        opset_version=18,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
    )


@pytest.mark.gpu
def test_tensorrt_engine_builds_caches_and_matches(model: TinyNet, tmp_path: Path) -> None:
    available, reason = tensorrt_available()
    if not available:
        pytest.skip(f"needs a CUDA GPU and TensorRT: {reason}")
    onnx_path = tmp_path / "model.onnx"
    _export_for_engine(model, onnx_path)
    batch = images(10)  # over the profile's max: run in chunks
    with torch.no_grad():
        reference = model(torch.from_numpy(batch)).numpy()

    def build(folder: str, *, fp16: bool, offset: float = 0.0) -> EngineOutcome:
        out = tmp_path / folder / "model.plan"
        return build_tensorrt_engine(
            onnx_path,
            out,
            profile=(1, 4, 8),
            fp16=fp16,
            cache_dir=tmp_path / "cache",
            parity_batch=batch,
            reference_logits=reference + offset,
        )

    first = build("a", fp16=False)
    assert first.built and not first.cache_hit, first.reason
    assert first.precision == "fp32" and first.path is not None and first.path.stat().st_size > 0
    assert first.parity_max_abs_diff is not None and first.parity_max_abs_diff <= 1e-4, first.reason
    second = build("b", fp16=False)
    assert second.cache_hit and second.key == first.key
    assert second.path is not None and second.path.read_bytes() == first.path.read_bytes()
    half = build("c", fp16=True)
    assert half.built and not half.cache_hit and half.key != first.key
    assert half.parity_max_abs_diff is not None and half.parity_max_abs_diff <= 2e-2, half.reason
    # a reference that is off by more than the bound is reported, not raised
    off = build("d", fp16=False, offset=1.0)
    assert off.built and off.cache_hit and off.parity_failed and "exceeds" in off.reason


@pytest.mark.gpu
def test_export_moves_a_cuda_model_back_to_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    model = trained_tiny_net(seed=5).cuda()
    path = tmp_path / "model.onnx"
    export_onnx(model, images(2), path)
    assert next(model.parameters()).is_cuda
    verdict = parity(model, path, images(4), atol=ATOL)
    assert verdict.passed, verdict.reason()
    assert next(model.parameters()).is_cuda
