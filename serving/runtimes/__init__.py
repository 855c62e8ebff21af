"""The runtime registry: ``LOADERS`` maps a runtime name to the file it loads and a loader that imports its
implementation inside the function, so a CPU host never imports TensorRT. The batch-first interface
every runtime implements is ``Runtime`` in serving/runtimes/base.py; the modules here import that, never
this registry.

``load_runtime`` builds the fallback chain of a version: TensorRT (``model.plan``) -> ONNX Runtime
(``model.onnx``) -> rules (``rules.json``), keeping the levels whose file the version has. With an
engine cache (serving/runtimes/engine_cache.py) the TensorRT level also covers a version whose
``model.plan`` this host cannot deserialize, or that has none, by building the engine from ``model.onnx``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serving.runtimes.base import Array, Runtime

if TYPE_CHECKING:
    from serving.model_format import ModelConfig
    from serving.runtimes.engine_cache import EngineCache
    from serving.runtimes.fallback import FallbackRuntime

log = logging.getLogger(__name__)

DEFAULT_ORDER: tuple[str, ...] = ("tensorrt", "onnxruntime", "rules")


@dataclass(frozen=True)
class LoadOptions:
    """How the loaders build runtimes (from the server's settings)."""

    ort_threads: int = 1
    engine_cache: EngineCache | None = None  # None: TensorRT only from a model.plan that deserializes
    fp16: bool = True  # precision of engines built on this host, where the GPU has fast FP16
    on_engine_lookup: Callable[[bool], None] | None = None  # engine cache hit (True) or miss (False)


def _tensorrt(path: Path, config: ModelConfig, options: LoadOptions) -> Runtime:
    from serving.errors import RuntimeFailure
    from serving.runtimes.tensorrt import TensorRTRuntime

    onnx = path.with_name("model.onnx")
    cache = options.engine_cache
    if path.is_file():
        try:
            return TensorRTRuntime(path)
        except RuntimeFailure as exc:
            if cache is None or not onnx.is_file() or "deserialize" not in str(exc):
                raise
            log.warning("%s; building the engine for this host from %s", exc, onnx.name)
    if cache is None:
        raise RuntimeFailure(f"{path} is missing and no engine cache is configured to build one from model.onnx")
    from serving.runtimes.engine_cache import cached_engine

    max_batch = int(config.to_dict()["batching"]["max_batch_size"])
    plan = cached_engine(onnx, max_batch, cache, fp16=options.fp16, on_lookup=options.on_engine_lookup)
    return TensorRTRuntime(plan)


def _onnxruntime(path: Path, config: ModelConfig, options: LoadOptions) -> Runtime:
    from serving.runtimes.onnxruntime import OnnxRuntime

    return OnnxRuntime(path, intra_op_threads=options.ort_threads)


def _rules(path: Path, config: ModelConfig, options: LoadOptions) -> Runtime:
    from serving.runtimes.rules import RulesRuntime

    return RulesRuntime(path, outputs=config.outputs)


# name -> (file it loads, loader). The file names match serving.model_format.PLATFORMS.
LOADERS: dict[str, tuple[str, Callable[[Path, ModelConfig, LoadOptions], Runtime]]] = {
    "tensorrt": ("model.plan", _tensorrt),
    "onnxruntime": ("model.onnx", _onnxruntime),
    "rules": ("rules.json", _rules),
}


def _has_level(name: str, version_dir: Path, options: LoadOptions) -> bool:
    """A level is tried when the version has its file; TensorRT also when an engine can be built here
    (an engine cache, model.onnx, and TensorRT installed: on a CPU host that stays quiet)."""
    if (version_dir / LOADERS[name][0]).is_file():
        return True
    return (
        name == "tensorrt"
        and options.engine_cache is not None
        and (version_dir / "model.onnx").is_file()
        and importlib.util.find_spec("tensorrt") is not None
    )


# Probe batches are zeros of the input's type; types outside this table probe as float32.
_PROBE_DTYPES: dict[str, type[np.generic]] = {
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "BOOL": np.bool_,
}


def probe_batch(config: ModelConfig) -> dict[str, Array]:
    """A batch of one row of zeros for every input in ``config`` (dynamic dimensions taken as 1)."""
    return {
        str(tensor["name"]): np.zeros(
            tuple(1 if int(d) < 0 else int(d) for d in [1, *list(tensor["shape"])[1:]]),
            dtype=_PROBE_DTYPES.get(str(tensor["datatype"]), np.float32),
        )
        for tensor in config.inputs
    }


def load_runtime(
    version_dir: Path,
    config: ModelConfig,
    *,
    order: Sequence[str] = DEFAULT_ORDER,
    ort_threads: int = 1,
    max_consecutive_errors: int = 5,
    probe_interval_s: float = 30.0,
    on_change: Callable[[str, int, str], None] | None = None,
    options: LoadOptions | None = None,
) -> FallbackRuntime:
    """The fallback chain of a verified version folder, loaded at its best working level.

    Args:
        version_dir: the version folder (already verified).
        config: its config.
        order: runtime names, best first; those whose file the version lacks are left out.
        ort_threads: ONNX Runtime intra-op threads.
        max_consecutive_errors: runtime errors in a row that drop one level.
        probe_interval_s: how often a fallen-back version retries its better levels (0: never).
        on_change: called with (level name, level index, reason) on every level change.
        options: engine cache and precision for the TensorRT level (``ort_threads`` wins over its own).

    Raises:
        RuntimeFailure: an unknown runtime name in ``order``, the version has none of the files the
            order names, or no level loads (the message lists each level's reason).
    """
    from serving.errors import RuntimeFailure
    from serving.runtimes.fallback import FallbackRuntime

    unknown = [name for name in order if name not in LOADERS]
    if unknown:
        raise RuntimeFailure(f"unknown runtimes {unknown} in the runtime order; known: {sorted(LOADERS)}")
    chosen = options or LoadOptions()
    chosen = LoadOptions(ort_threads, chosen.engine_cache, chosen.fp16, chosen.on_engine_lookup)
    levels = [
        (name, partial(LOADERS[name][1], version_dir / LOADERS[name][0], config, chosen))
        for name in order
        if _has_level(name, version_dir, chosen)
    ]
    if not levels:
        wanted = ", ".join(LOADERS[name][0] for name in order)
        raise RuntimeFailure(f"{version_dir} holds none of {wanted}: publish a model file, or change the runtime order")
    return FallbackRuntime(
        levels,
        max_consecutive_errors=max_consecutive_errors,
        probe_interval_s=probe_interval_s,
        probe_input=probe_batch(config),
        on_change=on_change,
    )
