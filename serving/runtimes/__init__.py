"""Inference runtimes behind one batch-first interface (DESIGN section 6).

A runtime takes a whole batch (``{input name: array}``) and returns ``{output name: array}``; batching,
routing and fallback stay outside it. Implementations are imported lazily by name, so a CPU host never
imports TensorRT.

``load_runtime`` builds the fallback chain of a version: TensorRT (``model.plan``) -> ONNX Runtime
(``model.onnx``) -> rules (``rules.json``), keeping the levels whose file the version has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from serving.model_format import ModelConfig
    from serving.runtimes.fallback import FallbackRuntime

Array = npt.NDArray[np.generic]

DEFAULT_ORDER: tuple[str, ...] = ("tensorrt", "onnxruntime", "rules")


class Runtime(Protocol):
    """One loaded model version, ready to run batches.

    ``name`` and ``providers`` are read-only here so that wrappers (the fallback chain, a batcher) can
    expose their inner runtime's values as properties and still be runtimes.
    """

    @property
    def name(self) -> str:  # "onnxruntime", "tensorrt", "rules"
        ...

    @property
    def providers(self) -> tuple[str, ...]:  # what really runs it (e.g. ONNX Runtime's session providers)
        ...

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]: ...

    def close(self) -> None: ...


def _tensorrt(path: Path, config: ModelConfig, ort_threads: int) -> Runtime:
    from serving.runtimes.tensorrt import TensorRTRuntime

    return TensorRTRuntime(path)


def _onnxruntime(path: Path, config: ModelConfig, ort_threads: int) -> Runtime:
    from serving.runtimes.onnxruntime import OnnxRuntime

    return OnnxRuntime(path, intra_op_threads=ort_threads)


def _rules(path: Path, config: ModelConfig, ort_threads: int) -> Runtime:
    from serving.runtimes.rules import RulesRuntime

    return RulesRuntime(path, outputs=config.outputs)


# name -> (file it loads, loader). The file names match serving.model_format.PLATFORMS.
LOADERS: dict[str, tuple[str, Callable[[Path, ModelConfig, int], Runtime]]] = {
    "tensorrt": ("model.plan", _tensorrt),
    "onnxruntime": ("model.onnx", _onnxruntime),
    "rules": ("rules.json", _rules),
}

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

    Raises:
        RuntimeFailure: an unknown runtime name in ``order``, the version has none of the files the
            order names, or no level loads (the message lists each level's reason).
    """
    from serving.errors import RuntimeFailure
    from serving.runtimes.fallback import FallbackRuntime

    unknown = [name for name in order if name not in LOADERS]
    if unknown:
        raise RuntimeFailure(f"unknown runtimes {unknown} in the runtime order; known: {sorted(LOADERS)}")
    levels = [
        (name, partial(LOADERS[name][1], version_dir / LOADERS[name][0], config, ort_threads))
        for name in order
        if (version_dir / LOADERS[name][0]).is_file()
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
