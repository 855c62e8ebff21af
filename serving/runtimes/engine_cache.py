"""TensorRT engines built from a version's ONNX file, cached by everything an engine depends on.

A serialized engine runs only on the TensorRT version and GPU model it was built for. The pipeline builds
``model.plan`` where it converts (and not at all on a CPU-only worker); a serving host of another GPU
type, or an image with a newer TensorRT, cannot deserialize it. Rather than serve from ONNX Runtime for
the life of the pod, the server builds the engine from ``model.onnx`` on first load and keeps it in its
engine cache, keyed by ``engine_key`` (ONNX sha256, TensorRT version, GPU name, precision, batch
profile): every later load of that version on that kind of host, by any pod sharing the cache volume, is
a hit. Triton's and ONNX Runtime's TensorRT execution provider keep an engine cache for the same reason.
The pipeline's conversion stage (tasks/conversion.py) uses the same key and builder, so its cache and
the server's agree. Lookups and hits are the ``sluicegate_tensorrt_engine_cache_*`` metrics.

Only ``EngineCache`` is exercised without a GPU (with another builder); ``build_plan`` and ``gpu_name``
need TensorRT and a CUDA device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_WORKSPACE_BYTES = 1 << 30
Build = Callable[[], tuple[bytes | None, str]]


def engine_key(onnx_sha256: str, trt_version: str, gpu_name: str, precision: str, profile: tuple[int, int, int]) -> str:
    """The cache key of an engine: an engine only runs on the TensorRT version and GPU it was built for."""
    fields = {
        "onnx_sha256": onnx_sha256,
        "tensorrt": trt_version,
        "gpu": gpu_name,
        "precision": precision,
        "profile": list(profile),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def batch_profile(max_batch_size: int) -> tuple[int, int, int]:
    """The optimisation profile (min, opt, max batch) the server builds for a version's batch cap."""
    top = max(1, int(max_batch_size))
    return 1, max(1, top // 2), top


class EngineCache:
    """A folder of serialized engines, ``<key>.plan``, written atomically, built at most once per key at
    a time in this process.

    Args:
        directory: Where engines are kept (a volume shared by the pods of one GPU type pays off most).
        on_lookup: Called with True (hit) or False (miss) on every lookup (the metrics).
    """

    def __init__(self, directory: Path, on_lookup: Callable[[bool], None] | None = None) -> None:
        self.directory = Path(directory)
        self._on_lookup = on_lookup
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(
        self, key: str, build: Build, on_lookup: Callable[[bool], None] | None = None
    ) -> tuple[Path | None, bool, str]:
        """The engine for ``key``: ``(path, hit, reason)``; on a miss ``build()`` makes it.

        ``build`` returns ``(serialized engine, "")`` or ``(None, reason)``; a failed build caches
        nothing and returns ``(None, False, reason)``. ``on_lookup`` overrides the cache's own hook for
        this call (the server labels each lookup with its model version).
        """
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # a second loader of the same engine waits and then hits
            path = self.directory / f"{key}.plan"
            hit = path.is_file()
            report = on_lookup or self._on_lookup
            if report is not None:
                report(hit)
            if hit:
                log.info("TensorRT engine cache hit %s", path)
                return path, True, "engine reused from the cache"
            plan, reason = build()
            if plan is None:
                return None, False, reason
            write_atomic(path, plan)
            return path, False, "engine built and cached"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def build_plan(
    onnx_path: Path,
    profile: tuple[int, int, int],
    precision: str,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> tuple[bytes | None, str]:
    """Parse the ONNX file and build a serialized engine (explicit batch, one optimisation profile over
    the batch axis); ``(None, reason)`` on failure. Needs TensorRT and a CUDA device."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    with warnings.catch_warnings():
        # TensorRT 10.x deprecates weakly typed networks (the FP16 flag); still the documented way here.
        warnings.simplefilter("ignore", DeprecationWarning)
        flags = 0
        explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
        if explicit is not None and int(str(trt.__version__).split(".")[0]) < 10:
            flags = 1 << int(explicit)  # TensorRT 8/9; explicit batch is the only mode in TensorRT 10
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, trt_logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            return None, f"TensorRT could not parse {onnx_path.name}: {errors}"
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
        optimisation = builder.create_optimization_profile()
        for index in range(network.num_inputs):
            tensor = network.get_input(index)
            rest = tuple(tensor.shape)[1:]
            if any(dim < 0 for dim in rest):
                return (
                    None,
                    f"input {tensor.name!r} has dynamic non-batch dims {tuple(tensor.shape)}: only batch may vary",
                )
            optimisation.set_shape(tensor.name, *[(size, *rest) for size in profile])
        config.add_optimization_profile(optimisation)
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif hasattr(trt.BuilderFlag, "TF32"):
            # TF32 is on by default on Ampere and later: ~1e-3 error, far above the fp32 parity bound.
            config.clear_flag(trt.BuilderFlag.TF32)
        started = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        return None, "TensorRT build_serialized_network returned nothing (see the TensorRT log above)"
    log.info("TensorRT engine built in %.1f s (%s, profile %s)", time.perf_counter() - started, precision, profile)
    return bytes(serialized), ""


def fast_fp16() -> bool:
    """Whether this GPU has fast FP16 kernels (TensorRT's own answer). Needs TensorRT."""
    import tensorrt as trt

    return bool(getattr(trt.Builder(trt.Logger(trt.Logger.WARNING)), "platform_has_fast_fp16", True))


def trt_version() -> str:
    import tensorrt as trt

    return str(trt.__version__)


def gpu_name(device: int = 0) -> str:
    """The CUDA device's name as the engine key records it (cuda-python, as the TensorRT runtime uses)."""
    from serving.runtimes.tensorrt import import_backends

    _, cudart = import_backends()
    error, properties = cudart.cudaGetDeviceProperties(device)
    if int(error) != 0:
        raise RuntimeError(f"cudaGetDeviceProperties({device}) failed: {error}")
    name: Any = properties.name
    return (bytes(name).split(b"\0", 1)[0].decode() if not isinstance(name, str) else name) or "GPU"


def cached_engine(
    onnx_path: Path,
    max_batch_size: int,
    cache: EngineCache,
    *,
    fp16: bool,
    on_lookup: Callable[[bool], None] | None = None,
) -> Path:
    """The engine of ``onnx_path`` for this host, from the cache or built into it (the server's path).

    Raises:
        RuntimeFailure: TensorRT or the GPU is missing, or the build failed (the reason is in the message).
    """
    from serving.errors import RuntimeFailure
    from serving.model_format import sha256_file
    from serving.runtimes.tensorrt import import_backends

    import_backends()  # RuntimeFailure("tensorrt unavailable: ...") before any work
    precision = "fp16" if fp16 and fast_fp16() else "fp32"
    profile = batch_profile(max_batch_size)
    key = engine_key(sha256_file(onnx_path), trt_version(), gpu_name(), precision, profile)
    path, _, reason = cache.get(key, lambda: build_plan(onnx_path, profile, precision), on_lookup)
    if path is None:
        raise RuntimeFailure(f"tensorrt: no engine for {onnx_path}: {reason}")
    log.info("%s: %s (%s, profile %s)", onnx_path, reason, precision, profile)
    return path
