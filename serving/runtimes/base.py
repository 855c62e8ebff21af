"""The batch-first interface every inference runtime implements (DESIGN section 6).

A runtime takes a whole batch (``{input name: array}``) and returns ``{output name: array}``; batching,
routing and fallback stay outside it (``FallbackRuntime`` and the batcher wrap runtimes, they are
runtimes too). The implementations (serving/runtimes/tensorrt.py, onnxruntime.py, rules.py) and the
registry (serving/runtimes/__init__.py) import this module; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.generic]


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
