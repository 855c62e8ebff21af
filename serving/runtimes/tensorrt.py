"""The TensorRT 10 runtime: a serialized engine (``model.plan``) run with explicit batch on one GPU.

TensorRT and cuda-python are imported in the constructor, so importing this module is free on a CPU
host; constructing the runtime there raises ``RuntimeFailure("tensorrt unavailable: ...")`` and the
fallback chain moves on to ONNX Runtime.

Concurrency: an execution context is not thread-safe, and contexts used at the same time must each select
a different optimisation profile (TensorRT's rule for dynamic shapes). So the runtime keeps one slot per
profile (up to ``max_contexts``): an execution context, its own CUDA stream and device buffers sized for
the profile's largest shapes, allocated once. A batch takes a free slot whose profile admits its shapes
and gives it back after the stream synchronises; callers never share a slot. An engine built with one
profile therefore runs one batch at a time, which is what the dynamic batcher in front of it expects;
build N identical profiles for N batches in flight.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.errors import InvalidInput, RuntimeFailure
from serving.runtimes.base import Array

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 30.0  # close() waits this long for running batches before freeing device memory


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    is_input: bool
    dtype: np.dtype[Any]


@dataclass(eq=False)  # slots are compared by identity in the free list
class _Slot:
    """One execution context with its stream, profile and device buffers; used by one batch at a time."""

    profile: int
    context: Any
    stream: Any
    bounds: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # input name -> (min shape, max shape)
    buffers: dict[str, int] = field(default_factory=dict)  # tensor name -> device pointer

    def admits(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        for name, shape in shapes.items():
            low, high = self.bounds[name]
            if len(shape) != len(low) or any(not lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)):
                return False
        return True


class TensorRTRuntime:
    """A deserialized TensorRT engine over one ``model.plan``.

    Args:
        plan_path: the serialized engine, built for this TensorRT version and GPU.
        device: the CUDA device index.
        max_contexts: at most this many execution contexts (one per optimisation profile).

    Raises:
        RuntimeFailure: TensorRT or cuda-python is missing, there is no usable GPU ("tensorrt
            unavailable: ..."), or the engine cannot be deserialized or is of a kind this runtime does not
            run (shape tensors, non-linear I/O formats, data-dependent output shapes).
    """

    name = "tensorrt"

    def __init__(self, plan_path: Path, *, device: int = 0, max_contexts: int = 4) -> None:
        self._trt, self._cudart = import_backends()
        self._device = device
        self._lock = threading.Condition()  # guards _free and _closed; notified when a slot comes back
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._closed = False
        self._engine: Any = None
        self._trt_runtime: Any = None
        try:
            gpu = self._open_device()
            self.providers: tuple[str, ...] = ("TensorRT", gpu)
            self._engine = self._deserialize(plan_path)
            self._specs = self._tensor_specs(plan_path)
            self.input_names = tuple(s.name for s in self._specs if s.is_input)
            self.output_names = tuple(s.name for s in self._specs if not s.is_input)
            profiles = max(1, int(self._engine.num_optimization_profiles))
            for profile in range(min(profiles, max_contexts)):
                self._add_slot(profile, plan_path)
        except BaseException:
            self._release_all()
            raise
        self._free = list(self._slots)
        self.max_batch_size = max((slot.bounds[self.input_names[0]][1] or (0,))[0] for slot in self._slots)
        log.info(
            "%s: TensorRT %s engine on %s, %d context(s), max batch %d",
            plan_path,
            self._trt.__version__,
            gpu,
            len(self._slots),
            self.max_batch_size,
        )

    # -- loading --------------------------------------------------------------------------------

    def _cuda(self, result: Any, what: str) -> Any:
        """Unpack a cuda-python ``(error, value...)`` tuple, raising on a CUDA error."""
        error = result[0]
        if error != self._cudart.cudaError_t.cudaSuccess:
            _, name = self._cudart.cudaGetErrorName(error)
            raise RuntimeFailure(f"CUDA {what} failed: {name.decode() if isinstance(name, bytes) else name}")
        return result[1] if len(result) == 2 else result[1:]

    def _open_device(self) -> str:
        try:
            count = self._cuda(self._cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
            if self._device >= count:
                raise RuntimeFailure(f"CUDA device {self._device} does not exist ({count} visible)")
            self._cuda(self._cudart.cudaSetDevice(self._device), "cudaSetDevice")
            properties = self._cuda(self._cudart.cudaGetDeviceProperties(self._device), "cudaGetDeviceProperties")
        except RuntimeFailure as exc:
            raise RuntimeFailure(f"tensorrt unavailable: no usable GPU ({exc})") from exc
        name = properties.name
        return (bytes(name).split(b"\0", 1)[0].decode() if not isinstance(name, str) else name) or "GPU"

    def _deserialize(self, plan_path: Path) -> Any:
        trt = self._trt
        self._trt_runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        try:
            plan = plan_path.read_bytes()
        except OSError as exc:
            raise RuntimeFailure(f"{plan_path} cannot be read ({exc}): restore or re-publish the version") from exc
        engine = self._trt_runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise RuntimeFailure(
                f"{plan_path}: TensorRT {trt.__version__} could not deserialize the engine (built for another "
                "TensorRT version or GPU?): rebuild model.plan on this kind of host; ONNX Runtime serves meanwhile"
            )
        return engine

    def _tensor_specs(self, plan_path: Path) -> list[_TensorSpec]:
        trt, engine = self._trt, self._engine
        specs: list[_TensorSpec] = []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            if engine.is_shape_inference_io(name):
                raise RuntimeFailure(f"{plan_path}: tensor {name!r} is a shape tensor; this runtime runs data tensors")
            if engine.get_tensor_format(name) != trt.TensorFormat.LINEAR:
                raise RuntimeFailure(
                    f"{plan_path}: tensor {name!r} has a vectorised format; build the engine with linear I/O formats"
                )
            try:
                dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            except TypeError as exc:
                raise RuntimeFailure(f"{plan_path}: tensor {name!r} has a type numpy cannot hold ({exc})") from exc
            specs.append(_TensorSpec(name, engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT, dtype))
        if not any(s.is_input for s in specs) or all(s.is_input for s in specs):
            raise RuntimeFailure(f"{plan_path}: the engine needs at least one input and one output tensor")
        return specs

    def _add_slot(self, profile: int, plan_path: Path) -> None:
        engine, cudart = self._engine, self._cudart
        context = engine.create_execution_context()
        if context is None:
            raise RuntimeFailure(f"{plan_path}: TensorRT could not create an execution context (out of GPU memory?)")
        # Non-blocking: no implicit synchronisation with the legacy default stream other libraries may use.
        flags = getattr(cudart, "cudaStreamNonBlocking", 1)
        stream = self._cuda(cudart.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags")
        slot = _Slot(profile, context, stream, {})
        self._slots.append(slot)  # registered before anything else can fail, so _release_all frees it
        if not context.set_optimization_profile_async(profile, int(stream)):
            raise RuntimeFailure(f"{plan_path}: selecting optimisation profile {profile} failed")
        self._cuda(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        for spec in self._specs:
            if spec.is_input:
                slot.bounds[spec.name] = self._profile_bounds(spec.name, profile)
                # The largest shapes, so the output sizes below (and the buffers) are the largest too.
                if not context.set_input_shape(spec.name, slot.bounds[spec.name][1]):
                    raise RuntimeFailure(f"{plan_path}: TensorRT refused the profile max shape of {spec.name!r}")
        for spec in self._specs:
            shape = tuple(slot.bounds[spec.name][1]) if spec.is_input else tuple(context.get_tensor_shape(spec.name))
            if any(d < 0 for d in shape):
                raise RuntimeFailure(
                    f"{plan_path}: output {spec.name!r} has a data-dependent shape {shape}; this runtime needs "
                    "output shapes that follow from the input shapes"
                )
            size = max(1, math.prod(shape)) * spec.dtype.itemsize
            slot.buffers[spec.name] = self._cuda(cudart.cudaMalloc(size), f"cudaMalloc({size} bytes)")
            # Buffers never move, so their addresses are bound once, not per batch.
            if not context.set_tensor_address(spec.name, slot.buffers[spec.name]):
                raise RuntimeFailure(f"{plan_path}: binding the buffer of {spec.name!r} failed")

    def _profile_bounds(self, name: str, profile: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        static = tuple(int(d) for d in self._engine.get_tensor_shape(name))
        if all(d >= 0 for d in static):  # a fully static input: its shape is its only admissible shape
            return static, static
        low, _, high = self._engine.get_tensor_profile_shape(name, profile)
        return tuple(int(d) for d in low), tuple(int(d) for d in high)

    # -- running --------------------------------------------------------------------------------

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        arrays = self._check_inputs(inputs)
        slot = self._acquire({name: a.shape for name, a in arrays.items()})
        try:
            return self._run(slot, arrays)
        finally:
            with self._lock:
                self._free.append(slot)
                self._lock.notify_all()

    def _check_inputs(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        arrays: dict[str, Array] = {}
        for spec in self._specs:
            if not spec.is_input:
                continue
            if spec.name not in inputs:
                raise InvalidInput(
                    f"input {spec.name!r} is missing; the TensorRT engine takes {list(self.input_names)}"
                )
            array = np.ascontiguousarray(inputs[spec.name])
            if array.dtype != spec.dtype:
                raise InvalidInput(f"input {spec.name!r} is {array.dtype}; the TensorRT engine takes {spec.dtype}")
            arrays[spec.name] = array
        return arrays

    def _acquire(self, shapes: Mapping[str, tuple[int, ...]]) -> _Slot:
        """A free slot whose profile admits ``shapes``, waiting for one if they are all busy."""
        if self._closed:
            raise RuntimeFailure("the TensorRT runtime is closed")
        fitting = [slot for slot in self._slots if slot.admits(shapes)]
        if not fitting:
            raise InvalidInput(self._refusal(shapes))
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeFailure("the TensorRT runtime is closed")
                slot = next((s for s in self._free if s in fitting), None)
                if slot is not None:
                    self._free.remove(slot)
                    return slot
                self._lock.wait()

    def _refusal(self, shapes: Mapping[str, tuple[int, ...]]) -> str:
        first = self.input_names[0]
        batch = shapes[first][0] if shapes[first] else 0
        if batch > self.max_batch_size:
            return (
                f"batch of {batch} rows is above the TensorRT engine's optimisation profile max {self.max_batch_size}: "
                f"send at most {self.max_batch_size} rows, or set batching.max_batch_size <= {self.max_batch_size} "
                "in config.json (or rebuild the engine with a larger profile)"
            )
        ranges = {name: [(s.bounds[name][0], s.bounds[name][1]) for s in self._slots] for name in shapes}
        return f"input shapes {dict(shapes)} fit none of the engine's optimisation profiles (min, max): {ranges}"

    def _run(self, slot: _Slot, arrays: Mapping[str, Array]) -> dict[str, Array]:
        cudart, context = self._cudart, slot.context
        # The device is per thread in the CUDA runtime: a batcher or gRPC worker thread starts on device 0.
        self._cuda(cudart.cudaSetDevice(self._device), "cudaSetDevice")
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name, array in arrays.items():
            if not context.set_input_shape(name, array.shape):
                raise InvalidInput(f"TensorRT refused the shape {array.shape} of input {name!r}")
            pointer = slot.buffers[name]
            self._cuda(
                cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, to_device, slot.stream), "memcpy"
            )
        outputs = {
            spec.name: np.empty(tuple(context.get_tensor_shape(spec.name)), dtype=spec.dtype)
            for spec in self._specs
            if not spec.is_input
        }
        if not context.execute_async_v3(int(slot.stream)):
            raise RuntimeFailure("TensorRT execute_async_v3 failed (see the TensorRT log)")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, out in outputs.items():
            self._cuda(
                cudart.cudaMemcpyAsync(out.ctypes.data, slot.buffers[name], out.nbytes, to_host, slot.stream), "memcpy"
            )
        # The host arrays above must stay alive until the copies land: wait for the stream before returning.
        self._cuda(cudart.cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize")
        return dict(outputs)

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for running batches (up to 30 s), then free the device buffers, streams and engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
            done = self._lock.wait_for(lambda: len(self._free) == len(self._slots), _CLOSE_TIMEOUT_S)
        if not done:
            log.error("TensorRT runtime closed with batches still running: leaking their device memory")
            return
        self._release_all()

    def _release_all(self) -> None:
        cudart = self._cudart
        for slot in self._slots:
            for pointer in slot.buffers.values():
                cudart.cudaFree(pointer)
            cudart.cudaStreamDestroy(slot.stream)
            slot.buffers.clear()
            slot.context = None
        self._slots, self._free = [], []
        # Contexts before the engine, the engine before the runtime that deserialized it.
        self._engine = None
        self._trt_runtime = None


def import_backends() -> tuple[Any, Any]:
    """``(tensorrt, cudart)``, or RuntimeFailure("tensorrt unavailable: ...") naming what is missing."""
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer is not
        raise RuntimeFailure(f"tensorrt unavailable: {exc}") from exc
    major = int(str(trt.__version__).split(".")[0])
    if major < 10:
        raise RuntimeFailure(
            f"tensorrt unavailable: TensorRT {trt.__version__} is older than 10 (this runtime uses the "
            "named-tensor API: set_input_shape, execute_async_v3); install tensorrt>=10"
        )
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except (ImportError, OSError) as exc:
            raise RuntimeFailure(f"tensorrt unavailable: cuda-python is not installed ({exc})") from exc
    return trt, cudart
