"""Gate 4: export a PyTorch model to ONNX, check parity with ONNX Runtime, build a TensorRT engine where possible.

Module-level imports are numpy, torch, onnx and the standard library only (plus the stdlib-only
``tasks.verdicts`` and ``sluicegate.ids``), so the GPU check runs this module on a machine without the
platform's other dependencies. onnxruntime and TensorRT are imported inside the functions that need them:
CPU machines never import TensorRT.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import torch

from serving.runtimes.engine_cache import (
    DEFAULT_WORKSPACE_BYTES,
    EngineCache,
    build_plan,
    engine_key,
    fast_fp16,
    trt_version,
)
from sluicegate.errors import SluicegateError
from sluicegate.ids import sha256_file
from tasks.verdicts import Check, GateVerdict

logger = logging.getLogger(__name__)

GATE = "convert"


class ConversionError(SluicegateError):
    """The model could not be exported (a bug or an unsupported model, not a quality verdict)."""


# --------------------------------------------------------------------------------------------------- ONNX


@contextlib.contextmanager
def _on_cpu_in_eval(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Put ``model`` in eval mode on the CPU for the block, then restore its device and training flags.

    Each submodule's flag is restored on its own: ``train(flag)`` would overwrite them all, e.g. put the
    shared inner model of a wrapper back into training mode.
    """
    modes = {module: module.training for module in model.modules()}
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise ConversionError(f"model has tensors on several devices {sorted(map(str, devices))}: move it to one")
    device = devices.pop() if devices else torch.device("cpu")
    try:
        model.to("cpu").eval()
        yield model
    finally:
        model.to(device)
        for module, training in modes.items():
            module.training = training


def _as_float32(batch: npt.ArrayLike) -> npt.NDArray[np.float32]:
    return np.ascontiguousarray(batch, dtype=np.float32)


def export_onnx(
    model: torch.nn.Module,
    example: np.ndarray,
    path: Path,
    *,
    opset: int = 18,
    input_name: str = "input",
    output_name: str = "logits",
) -> str:
    """Export ``model`` to one self-contained ONNX file with a dynamic batch axis.

    Uses the dynamo exporter (``torch.onnx.export(dynamo=True)``) on the CPU in eval mode; a CUDA model
    is moved to the CPU for the export and back afterwards. The file is written next to ``path`` and
    renamed into place, so ``path`` is never half-written.

    Args:
        model: the network; its first forward argument is the image batch ``(N, C, H, W)``.
        example: an input batch (float32) that fixes every dimension but the batch axis.
        path: the ``model.onnx`` to write.
        opset: ONNX opset (18 or more: the dynamo exporter cannot down-convert to 17).
        input_name: graph input name.
        output_name: graph output name.

    Returns:
        The sha256 of the written file.

    Raises:
        ConversionError: the exporter failed, the batch axis did not stay dynamic, or the model needs
            external data (over 2 GB).
        onnx.checker.ValidationError: the exported model is not valid ONNX.
    """
    x = torch.from_numpy(_as_float32(example))
    batch = torch.export.Dim("batch")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        program = _dynamo_export(model, x, batch, opset=opset, input_name=input_name, output_name=output_name)
        program.save(str(partial), external_data=False)
        _check_single_file(partial, input_name)
        onnx.checker.check_model(str(partial), full_check=True)
        partial.replace(path)
    except (ConversionError, onnx.checker.ValidationError):
        raise
    except Exception as exc:  # the exporter raises many types; say which model and why
        raise ConversionError(f"ONNX export of {type(model).__name__} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)
    return sha256_file(path)


def _dynamo_export(
    model: torch.nn.Module,
    x: torch.Tensor,
    batch: Any,
    *,
    opset: int,
    input_name: str,
    output_name: str,
) -> torch.onnx.ONNXProgram:
    """``torch.onnx.export(dynamo=True)`` of ``model`` on the CPU in eval mode, axis 0 of ``x`` dynamic."""
    with _on_cpu_in_eval(model), torch.no_grad(), warnings.catch_warnings():
        # The exporter's own FutureWarnings (pytree internals) are not ours to act on.
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(
            model,
            (x,),
            dynamo=True,
            opset_version=opset,
            input_names=[input_name],
            output_names=[output_name],
            dynamic_shapes=({0: batch},),
            external_data=False,
            verbose=False,
        )
    if program is None:  # only the legacy exporter returns None
        raise ConversionError("torch.onnx.export returned no program: is the dynamo exporter available?")
    return program


def _check_single_file(path: Path, input_name: str) -> None:
    proto = onnx.load(str(path), load_external_data=False)
    external = [t.name for t in proto.graph.initializer if onnx.external_data_helper.uses_external_data(t)]
    if external:
        raise ConversionError(f"{path.name} refers to external data for {external[:3]}: the model must fit one file")
    inputs = {i.name: i for i in proto.graph.input}
    if input_name not in inputs:
        raise ConversionError(f"exported graph has inputs {sorted(inputs)}, not {input_name!r}")
    first = inputs[input_name].type.tensor_type.shape.dim[0]
    if not first.dim_param:
        raise ConversionError(
            f"exported batch axis of {input_name!r} is fixed at {first.dim_value}: the model's forward must not "
            "depend on the batch size"
        )


def _opset(path: Path) -> int:
    proto = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)


def _torch_logits(model: torch.nn.Module, batch: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    with _on_cpu_in_eval(model), torch.no_grad():
        out = model(torch.from_numpy(batch))
    return np.asarray(out.detach().cpu().float().numpy(), dtype=np.float32)


def parity(model: torch.nn.Module, onnx_path: Path, batch: np.ndarray, *, atol: float) -> GateVerdict:
    """Compare PyTorch and ONNX Runtime on the same batch (the convert gate).

    PyTorch runs in eval mode under ``no_grad`` on the CPU in float32; ONNX Runtime runs the file with the
    CPU provider and every graph optimisation. The verdict holds two checks: ``onnx parity`` (max abs
    difference <= ``atol``) and ``dynamic batch`` (the session also runs batch sizes 1 and ``len(batch)``
    and returns ``(N, classes)``). A model that is not good enough gives a failed check, never an error.

    Args:
        model: the source network.
        onnx_path: the exported file.
        batch: a validation batch ``(N, C, H, W)``, N >= 1.
        atol: the largest allowed absolute difference.

    Returns:
        GateVerdict ``convert`` with metrics max_abs_diff, mean_abs_diff, providers, opset, batch_size.

    Raises:
        ValueError: the batch is empty.
    """
    import onnxruntime as ort

    data = _as_float32(batch)
    if data.ndim < 1 or data.shape[0] < 1:
        raise ValueError(f"parity batch must hold at least one item, got shape {data.shape}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name

    started = time.perf_counter()
    expected = _torch_logits(model, data)
    torch_s = time.perf_counter() - started
    started = time.perf_counter()
    actual, error = _ort_run(session, input_name, data)
    ort_s = time.perf_counter() - started

    metrics: dict[str, Any] = {
        "providers": list(session.get_providers()),
        "opset": _opset(onnx_path),
        "batch_size": int(data.shape[0]),
        "torch_seconds": round(torch_s, 6),
        "onnxruntime_seconds": round(ort_s, 6),
    }
    checks = [_parity_check(expected, actual, error, atol, metrics)]
    checks.append(_dynamic_batch_check(session, input_name, data, expected.shape[1:]))
    return GateVerdict(GATE, tuple(checks), metrics)


def _ort_run(session: Any, input_name: str, data: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float32], str]:
    try:
        return np.asarray(session.run(None, {input_name: data})[0], dtype=np.float32), ""
    except Exception as exc:  # ORT raises its own types (Fail, InvalidArgument, RuntimeException)
        return np.empty(0, dtype=np.float32), f"{type(exc).__name__}: {exc}"


def _parity_check(
    expected: npt.NDArray[np.float32],
    actual: npt.NDArray[np.float32],
    error: str,
    atol: float,
    metrics: dict[str, Any],
) -> Check:
    threshold = f"<= {atol:g}"
    if error or actual.shape != expected.shape:
        detail = error or f"ONNX Runtime gave shape {actual.shape}, PyTorch {expected.shape}"
        metrics.update(max_abs_diff=float("nan"), mean_abs_diff=float("nan"))
        return Check("onnx parity", float("nan"), threshold, False, detail)
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    max_diff, mean_diff = float(diff.max(initial=0.0)), float(diff.mean()) if diff.size else 0.0
    if not (np.isfinite(actual).all() and np.isfinite(expected).all()):
        max_diff = float("nan")  # a NaN never passes, even when both sides agree on it
    metrics.update(max_abs_diff=max_diff, mean_abs_diff=mean_diff)
    passed = bool(max_diff <= atol)
    detail = "" if passed else f"worst element {np.unravel_index(int(diff.argmax()), diff.shape)}; mean {mean_diff:.3g}"
    return Check("onnx parity", max_diff, threshold, passed, detail)


def _dynamic_batch_check(
    session: Any, input_name: str, data: npt.NDArray[np.float32], item_shape: tuple[int, ...]
) -> Check:
    sizes = sorted({1, len(data)} | ({2} if len(data) == 1 else set()))  # at least two sizes
    observed: dict[int, str] = {}
    problems: list[str] = []
    for size in sizes:
        sub = np.ascontiguousarray(np.resize(data, (size, *data.shape[1:])), dtype=np.float32)
        out, error = _ort_run(session, input_name, sub)
        observed[size] = error or str(tuple(out.shape))
        if error or tuple(out.shape) != (size, *item_shape):
            problems.append(f"batch {size}: {error or f'shape {tuple(out.shape)}, expected {(size, *item_shape)}'}")
    passed = not problems
    threshold = f"shape (N, {', '.join(map(str, item_shape))}) for N in {sizes}"
    return Check("dynamic batch", observed, threshold, passed, "; ".join(problems))


# ----------------------------------------------------------------------------------------------- TensorRT


@dataclass(frozen=True)
class EngineOutcome:
    """What building (or reusing) a TensorRT engine gave.

    ``built`` False means no engine (``reason`` says why: no GPU, TensorRT missing, parse or build
    failure); the pipeline records the step as skipped or failed with it. ``built`` True with a
    ``reason`` starting "parity" means the engine exists but its outputs are too far from the reference:
    the caller turns that into a failed check.
    """

    built: bool
    path: Path | None
    reason: str
    cache_hit: bool
    precision: str
    key: str | None
    parity_max_abs_diff: float | None

    @property
    def parity_failed(self) -> bool:
        return self.built and self.reason.startswith("parity")


def tensorrt_available() -> tuple[bool, str]:
    """Whether a CUDA GPU and the TensorRT Python package are both here; never raises.

    Returns:
        ``(True, "TensorRT <version> on <gpu>")`` or ``(False, reason)`` naming each missing part.
    """
    reasons: list[str] = []
    gpu = ""
    try:
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
        else:
            reasons.append("no CUDA GPU (torch.cuda.is_available() is False)")
    except Exception as exc:  # a broken driver raises from the query itself
        reasons.append(f"no CUDA GPU: {type(exc).__name__}: {exc}")
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or OSError for a missing libnvinfer
        reasons.append(f"TensorRT not installed: {type(exc).__name__}: {exc}")
        version = ""
    else:
        version = str(trt.__version__)
    if reasons:
        return False, "; ".join(reasons)
    return True, f"TensorRT {version} on {gpu}"


def build_tensorrt_engine(
    onnx_path: Path,
    out_path: Path,
    *,
    profile: tuple[int, int, int],
    fp16: bool,
    cache_dir: Path,
    parity_batch: np.ndarray | None = None,
    reference_logits: np.ndarray | None = None,
    fp16_atol: float = 2e-2,
    atol: float = 1e-4,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> EngineOutcome:
    """Build a TensorRT engine (``model.plan``) from an ONNX file, or reuse a cached one.

    Without a GPU or TensorRT this returns ``built=False`` with the reason. The cache key is
    sha256(onnx sha256, TensorRT version, GPU name, precision, profile); a cached engine is copied to
    ``out_path`` (``cache_hit=True``). When ``parity_batch`` and ``reference_logits`` are given the engine
    runs the batch and the max abs difference is recorded; above the bound (``fp16_atol`` for FP16,
    ``atol`` for FP32) the outcome says so in ``reason`` (``built`` stays True).

    Args:
        onnx_path: the exported model (dynamic batch axis, every other dimension fixed).
        out_path: where the engine is written (the repository's ``model.plan``).
        profile: min, opt, max batch sizes of the optimisation profile.
        fp16: enable FP16 kernels (ignored, and the precision recorded as fp32, if the GPU lacks fast FP16).
        cache_dir: folder of cached engines, ``<key>.plan``.
        parity_batch: inputs to compare on; needs ``reference_logits``.
        reference_logits: the expected outputs (PyTorch or ONNX Runtime) for ``parity_batch``.
        fp16_atol: parity bound for FP16 engines.
        atol: parity bound for FP32 engines.
        workspace_bytes: TensorRT workspace memory pool limit.

    Raises:
        ValueError: a malformed profile, or only one of parity_batch / reference_logits.
    """
    _check_profile(profile)
    if (parity_batch is None) != (reference_logits is None):
        raise ValueError("give both parity_batch and reference_logits, or neither")
    requested = "fp16" if fp16 else "fp32"
    available, why = tensorrt_available()
    if not available:
        return EngineOutcome(False, None, why, False, requested, None, None)

    # The server's engine cache code (same key, same builder), so an engine built here is a hit there.
    precision = "fp16" if fp16 and fast_fp16() else "fp32"
    key = engine_key(sha256_file(onnx_path), trt_version(), torch.cuda.get_device_name(0), precision, profile)
    cached, cache_hit, error = EngineCache(cache_dir).get(
        key, lambda: build_plan(onnx_path, profile, precision, workspace_bytes)
    )
    if cached is None:
        return EngineOutcome(False, None, error, False, precision, key, None)
    _copy_atomic(cached, out_path)
    reason = f"engine {'reused from cache' if cache_hit else 'built'} ({precision}, profile {profile})"
    built = EngineOutcome(True, out_path, reason, cache_hit, precision, key, None)
    if parity_batch is None or reference_logits is None:
        return built
    bound = fp16_atol if precision == "fp16" else atol
    return _with_parity(built, out_path, parity_batch, reference_logits, bound=bound, max_batch=profile[2])


def _with_parity(
    built: EngineOutcome,
    plan_path: Path,
    parity_batch: np.ndarray,
    reference_logits: np.ndarray,
    *,
    bound: float,
    max_batch: int,
) -> EngineOutcome:
    """``built`` with the engine at ``plan_path`` run on ``parity_batch`` and compared to ``reference_logits``:
    the max abs difference recorded, and ``reason`` starting "parity" when it is above ``bound``."""
    logits = run_engine(plan_path.read_bytes(), _as_float32(parity_batch), max_batch=max_batch)
    reference = np.asarray(reference_logits, dtype=np.float32)
    if logits.shape != reference.shape:
        why = f"parity: engine gave shape {logits.shape}, reference {reference.shape}"
        return replace(built, reason=why, parity_max_abs_diff=float("nan"))
    diff = float(np.abs(logits.astype(np.float64) - reference).max(initial=0.0))
    if not np.isfinite(logits).all():
        diff = float("nan")
    if not diff <= bound:
        why = f"parity max abs diff {diff:.4g} exceeds the {built.precision} bound {bound:g}"
        return replace(built, reason=why, parity_max_abs_diff=diff)
    return replace(built, reason=f"{built.reason}; parity {diff:.3g} <= {bound:g}", parity_max_abs_diff=diff)


def _check_profile(profile: tuple[int, int, int]) -> None:
    if len(profile) != 3 or not (1 <= profile[0] <= profile[1] <= profile[2]):
        raise ValueError(f"profile must be (min, opt, max) batch sizes with 1 <= min <= opt <= max, got {profile}")


_TRT_TO_TORCH = {"FLOAT": torch.float32, "HALF": torch.float16, "INT32": torch.int32, "INT64": torch.int64}


def run_engine(plan: bytes, batch: npt.NDArray[np.float32], *, max_batch: int) -> npt.NDArray[np.float32]:
    """Run a serialized engine on ``batch`` (in chunks of ``max_batch``) and return its first output.

    I/O buffers are torch CUDA tensors; the engine runs with ``execute_async_v3`` on a torch CUDA stream.
    """
    import tensorrt as trt

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise RuntimeError("TensorRT could not deserialize the engine (built for another TensorRT or GPU?)")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    input_name = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
    output_name = next(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)
    out_dtype = _TRT_TO_TORCH[engine.get_tensor_dtype(output_name).name]
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    outputs: list[npt.NDArray[np.float32]] = []
    for start in range(0, len(batch), max_batch):
        x = torch.from_numpy(np.ascontiguousarray(batch[start : start + max_batch])).cuda()
        context.set_input_shape(input_name, tuple(x.shape))
        out = torch.empty(tuple(context.get_tensor_shape(output_name)), dtype=out_dtype, device="cuda")
        context.set_tensor_address(input_name, x.data_ptr())
        context.set_tensor_address(output_name, out.data_ptr())
        stream.wait_stream(torch.cuda.current_stream())  # the host-to-device copy of x is on the default stream
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        stream.synchronize()
        outputs.append(out.float().cpu().numpy())
    return np.concatenate(outputs).astype(np.float32, copy=False)


def _copy_atomic(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        shutil.copyfile(source, partial)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
