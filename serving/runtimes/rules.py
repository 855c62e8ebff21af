"""The rule engine: the last level of the fallback chain, answering without a model.

When neither TensorRT nor ONNX Runtime can run a version, the server still answers, with one fixed,
conservative class for every row (for a defect inspector, usually a "send to manual review" or defect
class, never "good"), and every response is flagged abnormal so callers and dashboards can tell.

``rules.json`` (in the version folder, covered by ``SHA256SUMS`` like every file)::

    {
      "format": 1,
      "output": "logits",   # the output tensor to produce (must be one of config.json's outputs)
      "classes": 4,         # its width: the number of classes
      "answer": 1,          # the class every row gets (0-based index into the labels)
      "reason": "no model could run: route to manual inspection"  # logged and shown with the flag
    }

The output is one-hot logits (1.0 on ``answer``, 0.0 elsewhere), float32, shape ``(batch, classes)``:
argmax gives the answer, and the softmax confidence stays low (e^1 / (e^1 + classes - 1)), which the
server's confidence metrics show as what it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from serving.errors import InvalidInput, RuntimeFailure
from serving.runtimes.base import Array

RULES_FORMAT = 1
_KEYS = {"format", "output", "classes", "answer", "reason"}


class RulesRuntime:
    """A fixed, conservative answer per row from ``rules.json``, flagged abnormal.

    Args:
        path: the ``rules.json`` file.
        outputs: the version's ``config.json`` outputs; when given, ``output`` must be one of them and
            ``classes`` must match its last dimension (unless that is dynamic).

    Raises:
        RuntimeFailure: the file is missing, not JSON, or a field is missing or invalid (the message names
            the field and the fix).
    """

    name = "rules"
    providers: tuple[str, ...] = ("rules",)
    abnormal = True  # every answer is a fallback answer: responses are flagged

    def __init__(self, path: Path, *, outputs: Sequence[Mapping[str, Any]] = ()) -> None:
        raw = _read(path)
        self.output: str = _field(raw, path, "output", str, 'the output tensor name, e.g. "logits"')
        self.classes: int = _field(raw, path, "classes", int, "the number of classes, at least 1")
        self.answer: int = _field(raw, path, "answer", int, "the 0-based class index every row gets")
        self.reason: str = _field(raw, path, "reason", str, "why this answer is the safe one")
        if self.classes < 1:
            raise RuntimeFailure(f"{path}: 'classes' is {self.classes}: it must be at least 1")
        if not 0 <= self.answer < self.classes:
            raise RuntimeFailure(f"{path}: 'answer' {self.answer} is not a class index in [0, {self.classes})")
        if not self.output or not self.reason.strip():
            raise RuntimeFailure(f"{path}: 'output' and 'reason' must not be empty")
        _check_against(path, self.output, self.classes, outputs)
        self._row = np.zeros(self.classes, dtype=np.float32)
        self._row[self.answer] = 1.0

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        if not inputs:
            raise InvalidInput("the rules runtime needs at least one input tensor: it takes the batch size from it")
        sizes = {name: (array.shape[0] if array.ndim else None) for name, array in inputs.items()}
        batch = set(sizes.values())
        if None in batch or len(batch) != 1:
            raise InvalidInput(f"inputs must share one batch (first) dimension, got {sizes}")
        rows = int(next(iter(sizes.values())) or 0)
        return {self.output: np.tile(self._row, (rows, 1))}

    def close(self) -> None:
        """Nothing to release: the runtime holds one small array."""


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise RuntimeFailure(f"{path} does not exist: add rules.json to the version to get a rule fallback") from exc
    except ValueError as exc:
        raise RuntimeFailure(f"{path} is not valid JSON ({exc}): fix it and re-publish the version") from exc
    if not isinstance(raw, dict):
        raise RuntimeFailure(f"{path} must hold a JSON object, got {type(raw).__name__}")
    if raw.get("format") != RULES_FORMAT:
        raise RuntimeFailure(
            f"{path}: 'format' {raw.get('format')!r} is not {RULES_FORMAT}: this server cannot read it"
        )
    unknown = set(raw) - _KEYS
    if unknown:
        raise RuntimeFailure(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    return raw


def _field(raw: Mapping[str, Any], path: Path, key: str, kind: type[Any], meaning: str) -> Any:
    value = raw.get(key)
    # bool is an int subclass in Python; "classes": true is a mistake, not 1.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RuntimeFailure(f"{path}: {key!r} is {value!r}; it must be a {kind.__name__}: {meaning}")
    return value


def _check_against(path: Path, output: str, classes: int, outputs: Sequence[Mapping[str, Any]]) -> None:
    if not outputs:
        return
    shapes = {str(o["name"]): list(o["shape"]) for o in outputs}
    if output not in shapes:
        raise RuntimeFailure(f"{path}: 'output' {output!r} is not among config.json's outputs {sorted(shapes)}")
    width = shapes[output][-1] if shapes[output] else -1
    if width not in (-1, classes):
        raise RuntimeFailure(
            f"{path}: 'classes' {classes} does not match {output!r}'s last dimension {width} in config.json"
        )
