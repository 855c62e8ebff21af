"""The common ModelInfer request, decoded and answered without the general converters.

Almost every production request has the same form: ``raw_input_contents`` with one buffer per input, the
inputs in the model's order with its datatypes and shapes, no parameters. For one loaded version,
``InputPlan`` checks exactly that in a few comparisons and returns zero-copy arrays plus the batcher's
signature (precomputed when the shapes are fixed), and ``raw_response`` builds the answer with the
outputs' raw bytes. Anything else (typed contents, BYTES, parameters, another input order, a mistake)
returns None from ``decode`` and goes through serving/grpc_api/converters.py and the data plane's validation,
which name the field and the expected value in their errors: the plan never raises and never accepts
what the general path would refuse.

Why a second path: at thousands of requests a second on one core the general conversion (dataclasses,
per-field checks, the error bookkeeping of ``Budget``) cost as much as grpcio's own per-call work
(benchmarks/README.md); this one costs a few microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from serving.batching import Signature, signature
from serving.codec import Array
from serving.proto import grpc_service_pb2 as pb
from serving.types import DATATYPES


class InputPlan:
    """The fast decode of one model version's requests (see the module docstring).

    Args:
        inputs: Input name -> (V2 datatype, shape with -1 for free dimensions, the batch axis first),
            in the model's order.
        outputs: Output name -> V2 datatype, in the model's order.
        max_batch_size: The version's batch cap.
    """

    def __init__(
        self,
        inputs: Mapping[str, tuple[str, tuple[int, ...]]],
        outputs: Mapping[str, str],
        max_batch_size: int,
    ) -> None:
        self.max_rows = max_batch_size
        self.outputs = dict(outputs)
        # One entry per input: name, datatype, little-endian dtype, the non-batch dims, bytes per row
        # (None: a free non-batch dimension, so the row size comes from the request's shape).
        self.specs: list[tuple[str, str, np.dtype[Any], tuple[int, ...], int | None]] = []
        self.enabled = all(
            datatype in DATATYPES and datatype != "BYTES" and len(shape) >= 1 for datatype, shape in inputs.values()
        )
        fixed = True
        for name, (datatype, shape) in inputs.items():
            if not self.enabled:
                break
            dtype = DATATYPES[datatype].newbyteorder("<")
            tail = tuple(shape[1:])
            free = any(d < 0 for d in tail)
            fixed = fixed and not free
            row = None if free else int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
            self.specs.append((name, datatype, dtype, tail, row))
        self.enabled = self.enabled and bool(self.specs)
        # Fixed shapes: every accepted request has the same signature, so compute it once.
        self.signature: Signature | None = (
            signature({name: np.empty((1, *tail), dtype=dtype) for name, _, dtype, tail, _ in self.specs})
            if self.enabled and fixed
            else None
        )

    def decode(self, msg: Any, max_elements: int) -> tuple[dict[str, Array], int, Signature] | None:
        """``(arrays, rows, signature)`` of a request of the common form, or None for the general path."""
        if not self.enabled:
            return None
        items, raw, specs = msg.inputs, msg.raw_input_contents, self.specs
        if len(items) != len(specs) or len(raw) != len(specs) or msg.parameters:
            return None
        arrays: dict[str, Array] = {}
        rows = -1
        elements = 0
        for item, buffer, (name, datatype, dtype, tail, row) in zip(items, raw, specs, strict=True):
            if item.name != name or item.datatype != datatype or item.parameters or item.HasField("contents"):
                return None
            shape = tuple(item.shape)
            if len(shape) != len(tail) + 1:
                return None
            count = shape[0]
            if count < 1 or count > self.max_rows or (rows != -1 and count != rows):
                return None
            if row is None:
                if any(got < 0 or (want >= 0 and got != want) for got, want in zip(shape[1:], tail, strict=True)):
                    return None
                row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            elif shape[1:] != tail:
                return None
            if len(buffer) != count * row:
                return None
            elements += len(buffer) // dtype.itemsize
            rows = count
            arrays[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
        if elements > max_elements:
            return None
        for out in msg.outputs:
            if out.name not in self.outputs or out.parameters:
                return None
        return arrays, rows, self.signature or signature(arrays)

    def wanted_outputs(self, msg: Any) -> Sequence[str]:
        """The outputs a decoded request asked for (all, in the model's order, when it named none)."""
        return [out.name for out in msg.outputs] if msg.outputs else list(self.outputs)


def raw_response(
    model: str,
    version: str,
    request_id: str,
    names: Sequence[str],
    datatypes: Mapping[str, str],
    outputs: Mapping[str, Array],
    parameters: Mapping[str, bool] | None = None,
) -> Any:
    """A ``ModelInferResponse`` carrying ``outputs[name]`` for each name as raw little-endian bytes."""
    msg = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for key, flag in (parameters or {}).items():
        msg.parameters[key].bool_param = flag
    for name in names:
        array = outputs[name]
        datatype = datatypes[name]
        msg.outputs.add(name=name, datatype=datatype, shape=array.shape)
        wire = DATATYPES[datatype].newbyteorder("<")
        msg.raw_output_contents.append(np.ascontiguousarray(array, dtype=wire).tobytes())
    return msg
