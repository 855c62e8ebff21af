"""The ONNX Runtime runtime: CUDA execution provider where it works, else the CPU provider.

Session options are the ones serving wants for a small vision model under a dynamic batcher: full graph
optimisation, sequential execution (one batch at a time per session), an explicit intra-op thread count
(a server pinned to N cores should use N threads, not ONNX Runtime's guess from the whole machine), and
no spinning threads when idle, which would otherwise burn a core between batches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serving.runtimes.base import Array

log = logging.getLogger(__name__)

DEFAULT_PROVIDERS: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")


class OnnxRuntime:
    """An ``onnxruntime.InferenceSession`` over one ``model.onnx``.

    Args:
        model_path: the ``.onnx`` file.
        intra_op_threads: threads per operator (0: ONNX Runtime's default, one per physical core).
        providers: execution providers in order of preference; those this build lacks are skipped.
    """

    name = "onnxruntime"

    def __init__(
        self, model_path: Path, *, intra_op_threads: int = 0, providers: Sequence[str] = DEFAULT_PROVIDERS
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        available = set(ort.get_available_providers())
        wanted = [p for p in providers if p in available] or ["CPUExecutionProvider"]
        self._session = ort.InferenceSession(str(model_path), options, providers=wanted)
        # The session's providers are what really runs: a CUDA provider that failed to initialise (no
        # driver, no device) is silently dropped by ONNX Runtime, so the requested list would lie.
        self.providers: tuple[str, ...] = tuple(self._session.get_providers())
        if wanted[0] not in self.providers:
            log.warning("%s: %s unavailable, running on %s", model_path, wanted[0], self.providers[0])
        self.input_names = tuple(i.name for i in self._session.get_inputs())
        self.output_names = tuple(o.name for o in self._session.get_outputs())

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        feed: dict[str, Any] = {name: np.ascontiguousarray(inputs[name]) for name in self.input_names}
        outputs = self._session.run(list(self.output_names), feed)
        return dict(zip(self.output_names, outputs, strict=True))

    def close(self) -> None:
        # InferenceSession frees its memory when collected; drop our reference so it can be.
        self._session = None
