"""The V2 REST JSON inference request and response (the HTTP side port's route, with Triton's binary
tensor data extension) and model metadata <-> the data plane's types (serving/types.py).

Checked as strictly as gRPC (serving/grpc_api/converters.py), with the same shared checks and raw codec
(serving/codec.py): anything that does not convert raises ``InvalidInput`` naming the input, what is
wrong and what was expected.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from serving.codec import (
    DEFAULT_MAX_ELEMENTS,
    Array,
    Budget,
    decode_raw,
    encode_raw,
    flat_output,
    input_datatype,
    input_name,
    object_array,
    requested_output,
)
from serving.errors import InvalidInput
from serving.types import DATATYPES, InferRequest, InferResponse, ModelMetadata, RequestedOutput, Tensor


def request_from_json(
    model_name: str,
    model_version: str,
    body: Mapping[str, Any],
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    binary: bytes = b"",
) -> InferRequest:
    """Convert and validate a V2 REST inference request body (already parsed from JSON).

    ``data`` is a flat or nested list in row-major order; BYTES elements are strings (sent as UTF-8).
    With the binary tensor data extension (Triton's, which KServe's REST client uses by default), an
    input without ``data`` has ``parameters.binary_data_size`` and its raw bytes follow the JSON in
    ``binary``, in input order. Outputs come back binary when ``parameters.binary_data_output`` is true
    or every requested output asks for ``binary_data``.

    Raises:
        InvalidInput: As for :func:`serving.grpc_api.converters.request_from_proto`, plus a body of the wrong
            JSON shape or values of the wrong JSON type for the datatype.
    """
    if not isinstance(body, Mapping):
        raise InvalidInput(f"request body is {type(body).__name__}; expected a JSON object")
    inputs = _inputs_from_json(body.get("inputs"), Budget(max_elements), binary)
    outputs = _outputs_from_json(body.get("outputs"))
    parameters = _parameters_from_json(body.get("parameters"), "request")
    binary_out = bool(parameters.get("binary_data_output")) or (
        bool(outputs) and all(o.parameters.get("binary_data") is True for o in outputs)
    )
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        id=_json_id(body.get("id")),
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        raw_output=binary_out,
    )


def _inputs_from_json(items: Any, budget: Budget, binary: bytes) -> tuple[Tensor, ...]:
    """The request's inputs; those without ``data`` take their bytes from ``binary``, in order, all of it."""
    if not isinstance(items, list):
        raise InvalidInput(f"request 'inputs' is {items!r}; expected a list of input objects")
    inputs, offset = [], 0
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        tensor, offset = _input_from_json(item, index, seen, budget, binary, offset)
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} binary bytes after the JSON header belong to no input")
    return tuple(inputs)


def _input_from_json(
    item: Any, index: int, seen: dict[str, int], budget: Budget, binary: bytes, offset: int
) -> tuple[Tensor, int]:
    """Input ``index`` and the offset in ``binary`` after its bytes (unchanged when it sent ``data``)."""
    if not isinstance(item, Mapping):
        raise InvalidInput(
            f"input #{index} is {type(item).__name__}; expected an object with name, shape, datatype, data"
        )
    name = input_name(item.get("name"), index, seen)
    datatype = input_datatype(name, item.get("datatype"))
    dims = item.get("shape")
    if not isinstance(dims, list):
        raise InvalidInput(f"input {name!r}: shape is {dims!r}; expected a list of sizes")
    shape, count = budget.charge(name, dims)
    parameters = _parameters_from_json(item.get("parameters"), f"input {name!r}")
    size = parameters.pop("binary_data_size", None)
    if "data" in item:
        data = _from_json(name, datatype, shape, count, item["data"])
    elif isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= len(binary) - offset:
        data = decode_raw(name, datatype, shape, count, binary[offset : offset + size])
        offset += size
    else:
        raise InvalidInput(
            f"input {name!r} has neither 'data' (a JSON list) nor a binary_data_size within the "
            f"{len(binary) - offset} binary bytes left after the JSON header"
        )
    return Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters), offset


def _json_id(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"request 'id' is {value!r}; expected a string")
    return value


def _outputs_from_json(items: Any) -> tuple[RequestedOutput, ...]:
    if items is None:
        return ()
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise InvalidInput(f"request 'outputs' is {items!r}; expected a list of {{'name': ...}} objects")
    outputs = []
    taken: set[str] = set()
    for index, item in enumerate(items):
        parameters = _parameters_from_json(item.get("parameters"), f"output {item.get('name')!r}")
        outputs.append(requested_output(item.get("name"), index, taken, parameters))
    return tuple(outputs)


def _parameters_from_json(params: Any, where: str) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInput(f"{where}: parameters are {params!r}; expected a JSON object")
    for key, value in params.items():
        if not isinstance(value, bool | int | float | str):
            raise InvalidInput(f"{where}: parameter {key!r} is {value!r}; expected a boolean, number or string")
    return dict(params)


def _flatten(name: str, data: Any, count: int) -> list[Any]:
    """Row-major leaves of a nested list; stops early once more than ``count`` are found."""
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: data is {type(data).__name__}; expected a JSON list (flat or nested)")
    leaves: list[Any] = []
    stack: list[Iterable[Any]] = [iter(data)]
    while stack and len(leaves) <= count:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            leaves.append(value)
        else:
            stack.pop()
    return leaves


def _from_json(name: str, datatype: str, shape: tuple[int, ...], count: int, data: Any) -> Array:
    leaves = _flatten(name, data, count)
    if len(leaves) != count:
        got = f"more than {count}" if len(leaves) > count else str(len(leaves))
        raise InvalidInput(
            f"input {name!r}: {got} {datatype} elements in data for shape {list(shape)}; expected {count}"
        )
    dtype = DATATYPES[datatype]
    kind = "BYTES" if datatype == "BYTES" else dtype.kind
    bad = next((v for v in leaves if not _json_fits(kind, v)), _OK)
    if bad is not _OK:
        raise InvalidInput(f"input {name!r}: {datatype} data holds {bad!r}; expected {_JSON_EXPECTED[kind]}")
    if datatype == "BYTES":
        return object_array([v.encode() for v in leaves]).reshape(shape)
    if kind == "f":
        return _json_floats(name, datatype, leaves).reshape(shape)
    if kind in "iu" and leaves:
        info = np.iinfo(dtype)
        low, high = min(leaves), max(leaves)
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise InvalidInput(
                f"input {name!r}: value {bad} is out of range for {datatype}; expected {info.min}..{info.max}"
            )
    return np.array(leaves, dtype=dtype).reshape(shape)


def _json_floats(name: str, datatype: str, leaves: list[Any]) -> Array:
    """Floats, refusing finite values that the datatype would turn into infinity."""
    dtype, limit = DATATYPES[datatype], float(np.finfo(DATATYPES[datatype]).max)
    try:
        wide = np.array(leaves, dtype=np.float64)
    except OverflowError as exc:  # a JSON integer beyond any float
        raise InvalidInput(
            f"input {name!r}: a value is out of range for {datatype}; expected at most {limit:g}"
        ) from exc
    with np.errstate(over="ignore"):
        narrow = wide.astype(dtype)
    overflow = np.isinf(narrow) & np.isfinite(wide)
    if overflow.any():
        bad = wide[overflow][0]
        raise InvalidInput(f"input {name!r}: value {bad:g} is out of range for {datatype}; expected at most {limit:g}")
    return narrow


_OK = object()
_JSON_EXPECTED = {"BYTES": "strings", "b": "true or false", "i": "integers", "u": "integers", "f": "numbers"}


def _json_fits(kind: str, value: Any) -> bool:
    # bool is an int subclass in Python, but JSON true is no number and 1 is no boolean.
    if kind == "BYTES":
        return isinstance(value, str)
    if isinstance(value, bool):
        return kind == "b"
    if kind in "iu":
        return isinstance(value, int)
    return kind == "f" and isinstance(value, int | float)


def response_to_binary(resp: InferResponse) -> tuple[bytes, int]:
    """The binary-extension response: JSON header (outputs carry ``binary_data_size``, no ``data``)
    followed by each output's raw bytes; returns (body, length of the JSON header)."""
    body = response_to_json(resp, with_data=False)
    chunks = []
    for tensor, out in zip(resp.outputs, body["outputs"], strict=True):
        raw = encode_raw(tensor.datatype, flat_output(tensor))
        out.setdefault("parameters", {})["binary_data_size"] = len(raw)
        chunks.append(raw)
    header = json.dumps(body).encode()
    return header + b"".join(chunks), len(header)


def response_to_json(resp: InferResponse, *, with_data: bool = True) -> dict[str, Any]:
    """A V2 REST inference response body; BYTES outputs become UTF-8 strings.

    Raises:
        InvalidInput: A BYTES output is not UTF-8 text, so JSON cannot carry it (the gRPC route can).
    """
    body: dict[str, Any] = {
        "model_name": resp.model_name,
        "model_version": resp.model_version,
        "outputs": [_output_json(tensor) if with_data else _output_meta(tensor) for tensor in resp.outputs],
    }
    if resp.id:
        body["id"] = resp.id
    if resp.parameters:
        body["parameters"] = _json_parameters(resp.parameters)
    return body


def _output_json(tensor: Tensor) -> dict[str, Any]:
    flat = flat_output(tensor)
    if tensor.datatype == "BYTES":
        data: list[Any] = []
        for index, item in enumerate(flat):
            try:
                data.append(item if isinstance(item, str) else bytes(item).decode())
            except UnicodeDecodeError as exc:
                raise InvalidInput(
                    f"output {tensor.name!r}: element {index} is not UTF-8 text, which JSON cannot carry; "
                    "request it over gRPC (raw_output_contents)"
                ) from exc
    else:
        data = flat.tolist()
    out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape), "data": data}
    if tensor.parameters:
        out["parameters"] = _json_parameters(tensor.parameters)
    return out


def _output_meta(tensor: Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
    if tensor.parameters:
        out["parameters"] = _json_parameters(tensor.parameters)
    return out


def _json_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    # numpy scalars are not JSON serialisable; .item() gives the Python value.
    return {key: value.item() if isinstance(value, np.generic) else value for key, value in params.items()}


def metadata_to_json(meta: ModelMetadata) -> dict[str, Any]:
    """The V2 REST model metadata body (``name``, ``versions``, ``platform``, ``inputs``, ``outputs``)."""

    def tensors(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": tensors(meta.inputs),
        "outputs": tensors(meta.outputs),
    }
