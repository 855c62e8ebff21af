"""KServe V2 / Open Inference Protocol gRPC ModelInferRequest/ModelInferResponse <-> the data plane's
types (serving/types.py): the general path of ModelInfer (serving/grpc_api/fast_infer.py takes the
common form).

A request that converts has tensors whose data matches their datatype and shape, within the element cap
(the shared checks and raw codec of serving/codec.py); anything else raises ``InvalidInput`` naming the
input, what is wrong and what was expected. Metadata, repository index, ModelConfig and ModelStatistics
convert in serving/grpc_api/converters_meta.py; the REST JSON route in serving/rest_api/converters.py.

Wire rules (V2 spec): raw contents follow serving/codec.py (little-endian, row-major, length-prefixed
BYTES); raw and typed contents never mix in one message; FP16 has no typed field, so it travels raw only.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from serving.codec import (
    DEFAULT_MAX_ELEMENTS,
    Array,
    Budget,
    as_bytes,
    decode_raw,
    encode_raw,
    flat_output,
    input_datatype,
    input_name,
    object_array,
    requested_output,
)
from serving.errors import InvalidInput, clip
from serving.proto import grpc_service_pb2 as pb
from serving.types import DATATYPES, InferRequest, InferResponse, Tensor

# V2 datatype -> the InferTensorContents field that carries it. FP16 is absent: raw only.
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
# The numpy type of each contents field, for decoding before any narrowing to the datatype.
_FIELD_DTYPE: dict[str, np.dtype[Any]] = {
    "bool_contents": np.dtype(np.bool_),
    "int_contents": np.dtype(np.int32),
    "int64_contents": np.dtype(np.int64),
    "uint_contents": np.dtype(np.uint32),
    "uint64_contents": np.dtype(np.uint64),
    "fp32_contents": np.dtype(np.float32),
    "fp64_contents": np.dtype(np.float64),
}
_PARAMETER_FIELDS = ("bool_param", "int64_param", "string_param", "double_param", "uint64_param")


def _some(names: Sequence[str], limit: int = 8) -> str:
    """Names for a message, a few only: a status message travels in a size-limited gRPC trailer."""
    shown = ", ".join(repr(n[:64]) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def _count_error(name: str, datatype: str, got: int, where: str, shape: tuple[int, ...], count: int) -> InvalidInput:
    return InvalidInput(
        f"input {name!r}: {got} {datatype} elements in {where} for shape {list(shape)}; expected {count}"
    )


def _narrow(name: str, datatype: str, values: Array) -> Array:
    """Cast to the datatype, refusing values that do not fit (INT8 travels in int32 fields, for one)."""
    target = DATATYPES[datatype]
    if values.size and target.kind in "iu" and values.dtype.itemsize > target.itemsize:
        info = np.iinfo(target)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(
                f"input {name!r}: value {bad} is out of range for {datatype}; expected {info.min}..{info.max}"
            )
    return values.astype(target, copy=False)


# --------------------------------------------------------------------------------------------------
# gRPC request
# --------------------------------------------------------------------------------------------------


def request_from_proto(
    msg: pb.ModelInferRequest,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    expected: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> InferRequest:
    """Convert and validate a ``ModelInferRequest``.

    Every check that needs no data comes before any tensor is decoded: names, datatypes, shapes, the
    element cap, buffer counts, and (given ``expected``) the model's input names and datatypes. Decoding
    is what costs: 8 M one-byte BYTES elements sent to an FP32 input took 6 s and 800 MB to decode only
    to be refused for their datatype.

    Args:
        msg: The request as received.
        max_elements: Cap on the elements of all inputs together.
        expected: The routed version's inputs (name -> (V2 datatype, shape)), when known.

    Returns:
        The request; ``raw_output`` is True when it used ``raw_input_contents``, unless a boolean
        ``binary_data_output`` request parameter says otherwise.

    Raises:
        InvalidInput: Unknown datatype; negative or oversized shape; element count, raw byte length or
            raw buffer count that does not match; raw and typed contents mixed; duplicate or unnamed
            inputs or outputs; a parameter without a value; an input or datatype ``expected`` lacks.
    """
    raw = msg.raw_input_contents
    names = [item.name for item in msg.inputs]
    if raw and len(raw) != len(names):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} buffers for the {len(names)} inputs {_some(names)}; expected "
            "one buffer per input, in the order of inputs"
        )
    budget = Budget(max_elements)
    seen: dict[str, int] = {}
    headers: list[tuple[Any, str, str, tuple[int, ...], int]] = []
    for index, item in enumerate(msg.inputs):
        name = input_name(item.name, index, seen)
        datatype = input_datatype(name, item.datatype)
        shape, count = budget.charge(name, item.shape)
        if raw:
            typed = [field.name for field, _ in item.contents.ListFields()]
            if typed:
                raise InvalidInput(
                    f"input {name!r} has typed contents ({typed[0]}) while the request sends raw_input_contents; "
                    "expected one or the other for the whole request"
                )
        headers.append((item, name, datatype, shape, count))
    if expected is not None:
        _check_expected(msg.model_name, expected, [(name, datatype) for _, name, datatype, _, _ in headers])
    inputs = []
    for index, (item, name, datatype, shape, count) in enumerate(headers):
        if raw:
            data = decode_raw(name, datatype, shape, count, raw[index])
        else:
            data = _from_contents(name, datatype, shape, count, item.contents)
        parameters = _parameters_from_proto(item.parameters, f"input {name!r}")
        inputs.append(Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters))
    outputs = []
    taken: set[str] = set()
    for index, out in enumerate(msg.outputs):
        parameters = _parameters_from_proto(out.parameters, f"output {out.name!r}")
        outputs.append(requested_output(out.name, index, taken, parameters))
    parameters = _parameters_from_proto(msg.parameters, "request")
    binary = parameters.get("binary_data_output")
    return InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        id=msg.id,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        parameters=parameters,
        raw_output=binary if isinstance(binary, bool) else bool(raw),
    )


def _check_expected(
    model: str, expected: Mapping[str, tuple[str, tuple[int, ...]]], given: Sequence[tuple[str, str]]
) -> None:
    """The request's input names and datatypes against the model's, worded as the data plane's
    ``validate_inputs`` words them (which still checks shapes and batch sizes after decoding)."""
    names = {name for name, _ in given}
    missing, unknown = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unknown:
        raise InvalidInput(
            f"model {clip(model)!r} takes inputs {sorted(expected)}; missing {missing}, unexpected {_some(unknown)}"
        )
    for name, datatype in given:
        if datatype != expected[name][0]:
            raise InvalidInput(f"input {name!r}: datatype {datatype}, expected {expected[name][0]}")


def _from_contents(
    name: str, datatype: str, shape: tuple[int, ...], count: int, contents: pb.InferTensorContents
) -> Array:
    field = _CONTENTS_FIELD.get(datatype)
    for other, _ in contents.ListFields():
        if other.name != field:
            expected = field or "raw_input_contents (FP16 has no typed field)"
            raise InvalidInput(f"input {name!r}: {datatype} data sent in {other.name}; expected {expected}")
    if field is None:
        if count:
            raise InvalidInput(
                f"input {name!r}: no data for shape {list(shape)}; expected {count} {datatype} elements in "
                "raw_input_contents (FP16 has no typed field)"
            )
        return np.empty(shape, dtype=DATATYPES[datatype])
    values = getattr(contents, field)
    if len(values) != count:
        raise _count_error(name, datatype, len(values), f"contents.{field}", shape, count)
    if datatype == "BYTES":
        return object_array(list(values)).reshape(shape)
    decoded = np.fromiter(values, dtype=_FIELD_DTYPE[field], count=count)
    return _narrow(name, datatype, decoded).reshape(shape)


def _parameters_from_proto(params: Mapping[str, pb.InferParameter], where: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        if choice is None:
            raise InvalidInput(
                f"{where}: parameter {key!r} has no value; expected one of {', '.join(_PARAMETER_FIELDS)}"
            )
        result[key] = getattr(param, choice)
    return result


# --------------------------------------------------------------------------------------------------
# gRPC response
# --------------------------------------------------------------------------------------------------


def response_to_proto(resp: InferResponse, raw: bool) -> pb.ModelInferResponse:
    """Convert a response; ``raw`` chooses ``raw_output_contents`` (one buffer per output, in order).

    An FP16 output makes the whole response raw: FP16 has no typed field, and the V2 spec forbids
    mixing raw and typed outputs in one response.
    """
    raw = raw or any(t.datatype not in _CONTENTS_FIELD for t in resp.outputs)
    msg = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version, id=resp.id)
    _fill_parameters(msg.parameters, resp.parameters, "response")
    for tensor in resp.outputs:
        out = msg.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        _fill_parameters(out.parameters, tensor.parameters, f"output {tensor.name!r}")
        flat = flat_output(tensor)
        if raw:
            msg.raw_output_contents.append(encode_raw(tensor.datatype, flat))
        elif tensor.datatype == "BYTES":
            out.contents.bytes_contents.extend(as_bytes(item) for item in flat)
        else:
            getattr(out.contents, _CONTENTS_FIELD[tensor.datatype]).extend(flat.tolist())
    return msg


def _fill_parameters(target: MutableMapping[str, pb.InferParameter], params: Mapping[str, Any], where: str) -> None:
    for key, value in params.items():
        param = target[key]
        if isinstance(value, bool | np.bool_):
            param.bool_param = bool(value)
        elif isinstance(value, int | np.integer) and -(2**63) <= int(value) < 2**63:
            param.int64_param = int(value)
        elif isinstance(value, int | np.integer) and 0 <= int(value) < 2**64:
            param.uint64_param = int(value)
        elif isinstance(value, float | np.floating):
            param.double_param = float(value)
        elif isinstance(value, str):
            param.string_param = value
        else:
            raise TypeError(f"{where}: parameter {key!r} is {value!r}; expected bool, a 64-bit int, float or str")
