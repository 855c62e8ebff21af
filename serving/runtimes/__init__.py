"""Inference runtimes behind one batch-first interface (DESIGN section 6).

A runtime takes a whole batch (``{input name: array}``) and returns ``{output name: array}``; batching,
routing and fallback stay outside it. Implementations are imported lazily by name, so a CPU host never
imports TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.generic]


class Runtime(Protocol):
    """One loaded model version, ready to run batches."""

    name: str  # "onnxruntime", "tensorrt", "rules"
    providers: tuple[str, ...]  # what really runs it (e.g. ONNX Runtime's session providers), not what was asked

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]: ...

    def close(self) -> None: ...
