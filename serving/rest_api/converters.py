"""The V2 REST JSON inference request and response (the HTTP side port's route, with Triton's binary
tensor data extension) and model metadata <-> the data plane's types (serving/types.py).

Checked as strictly as gRPC (serving/grpc_api/converters.py), with the same shared checks and raw codec
(serving/codec.py): anything that does not convert raises ``InvalidInput`` naming the input, what is
wrong and what was expected.

Hostile bodies are refused before they cost anything: ``parse_json`` measures the nesting depth on the
raw bytes before ``json.loads`` recurses into it; a tensor's name, datatype, shape, element count and
byte size are checked before any list is flattened or any buffer sliced; and every request value a
message echoes goes through ``echo`` (at most ``max_echo_chars``), so a 50 MiB input name cannot
become a 50 MiB error body or log line. These checks sit here rather than in codec.py because only
JSON carries arbitrary Python values (gRPC's protobuf types bound them already).
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np

from serving.codec import (
    DEFAULT_MAX_ELEMENTS,
    MAX_DIMS,
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
from serving.errors import ECHO_CHARS, InvalidInput
from serving.types import DATATYPES, InferRequest, InferResponse, ModelMetadata, RequestedOutput, Tensor

DEFAULT_MAX_JSON_DEPTH = 32
_DEPTH_CHUNK = 1 << 20  # bytes scanned per numpy pass: bounded temporaries whatever the body size
_OPEN, _CLOSE, _QUOTE = (ord("["), ord("{")), (ord("]"), ord("}")), ord('"')


def echo(value: Any, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, built without the whole repr (reprlib), so
    echoing a huge request value in a message costs no more than a short one."""
    shortener = reprlib.Repr()
    shortener.maxstring = shortener.maxother = shortener.maxlong = max(limit, 16)
    shortener.maxlist = shortener.maxdict = shortener.maxtuple = shortener.maxset = max(limit // 8, 4)
    text = shortener.repr(value)
    return text if len(text) <= limit + 8 else text[:limit] + "..."


def parse_json(raw: bytes | bytearray | memoryview, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """A JSON object from a request body; empty means ``{}``.

    Raises:
        InvalidInput: Not JSON, not an object, or nested deeper than ``max_depth`` (checked on the bytes
            first: ``json.loads`` recurses per level, and 100,000 nested lists would exhaust the stack).
    """
    data = bytes(raw) if isinstance(raw, memoryview) else raw
    depth = json_depth(data, max_depth)
    if depth > max_depth:
        raise InvalidInput(
            f"request body nests JSON {depth if depth <= 10 * max_depth else f'more than {10 * max_depth}'} "
            f"levels deep; expected at most {max_depth} (the server's http_max_json_depth)"
        )
    try:
        body = json.loads(data or b"{}")
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidInput(f"request body is not JSON: {echo(str(exc))}") from exc
    if not isinstance(body, dict):
        raise InvalidInput(f"request body is a JSON {type(body).__name__}; expected a JSON object")
    return body


def json_depth(raw: bytes | bytearray, limit: int = DEFAULT_MAX_JSON_DEPTH) -> int:
    """The deepest nesting of ``[``/``{`` outside strings, or an upper bound when that is at most
    ``limit``; scanning stops past ``10 * limit``.

    Vectorised over 1 MiB chunks (numpy), so a 100 MiB body costs a fraction of a second and a few MiB.
    Escaped backslashes and quotes are dropped first so a quote inside a string cannot end it early."""
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets <= limit:  # cannot nest deeper than it has brackets: the common case costs two scans
        return brackets
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(raw, dtype=np.uint8)
    depth, peak, in_string = 0, 0, False
    for start in range(0, len(data), _DEPTH_CHUNK):
        chunk = data[start : start + _DEPTH_CHUNK]
        inside = np.cumsum(chunk == _QUOTE, dtype=np.int32) & 1
        if in_string:
            inside ^= 1
        opens = (chunk == _OPEN[0]) | (chunk == _OPEN[1])
        closes = (chunk == _CLOSE[0]) | (chunk == _CLOSE[1])
        step = (opens.astype(np.int64) - closes) * (inside == 0)
        levels = depth + np.cumsum(step)
        if len(levels):
            peak, depth = max(peak, int(levels.max())), int(levels[-1])
            in_string = bool(inside[-1])
        if peak > 10 * limit:
            break
    return peak


def request_from_json(
    model_name: str,
    model_version: str,
    body: Mapping[str, Any],
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    binary: bytes | bytearray | memoryview = b"",
    max_echo_chars: int = ECHO_CHARS,
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
    limit = max_echo_chars
    inputs = _inputs_from_json(body.get("inputs"), Budget(max_elements), memoryview(binary), limit)
    outputs = _outputs_from_json(body.get("outputs"), limit)
    parameters = _parameters_from_json(body.get("parameters"), "request", limit)
    binary_out = bool(parameters.get("binary_data_output")) or (
        bool(outputs) and all(o.parameters.get("binary_data") is True for o in outputs)
    )
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        id=_json_id(body.get("id"), limit),
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        raw_output=binary_out,
    )


def _inputs_from_json(items: Any, budget: Budget, binary: memoryview, limit: int) -> tuple[Tensor, ...]:
    """The request's inputs; those without ``data`` take their bytes from ``binary``, in order, all of it."""
    if not isinstance(items, list):
        raise InvalidInput(f"request 'inputs' is {echo(items, limit)}; expected a list of input objects")
    inputs, offset = [], 0
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        tensor, offset = _input_from_json(item, index, seen, budget, binary, offset, limit)
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} binary bytes after the JSON header belong to no input")
    return tuple(inputs)


def _input_from_json(
    item: Any, index: int, seen: dict[str, int], budget: Budget, binary: memoryview, offset: int, limit: int
) -> tuple[Tensor, int]:
    """Input ``index`` and the offset in ``binary`` after its bytes (unchanged when it sent ``data``).

    Everything the data's size depends on (name, datatype, shape, element cap, binary_data_size) is
    checked before the data is touched."""
    if not isinstance(item, Mapping):
        raise InvalidInput(
            f"input #{index} is {type(item).__name__}; expected an object with name, shape, datatype, data"
        )
    raw_name = item.get("name")
    if isinstance(raw_name, str) and len(raw_name) > limit:
        # No model input has such a name; refused here so codec.py's messages never echo it whole.
        raise InvalidInput(
            f"input #{index}: name {echo(raw_name, limit)} has {len(raw_name)} characters; expected the name "
            f"of a model input (at most {limit} characters)"
        )
    name = input_name(raw_name, index, seen)
    if item.get("datatype") not in DATATYPES:
        raise InvalidInput(
            f"input {name!r}: datatype {echo(item.get('datatype'), limit)} is not a V2 datatype; "
            f"expected one of {', '.join(DATATYPES)}"
        )
    datatype = input_datatype(name, item.get("datatype"))
    dims = item.get("shape")
    if not isinstance(dims, list):
        raise InvalidInput(f"input {name!r}: shape is {echo(dims, limit)}; expected a list of sizes")
    if len(dims) > MAX_DIMS:
        raise InvalidInput(f"input {name!r}: shape has {len(dims)} dimensions; expected at most {MAX_DIMS}")
    for axis, dim in enumerate(dims):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise InvalidInput(f"input {name!r}: dimension {axis} is {echo(dim, limit)}; expected an integer size")
        if dim > budget.cap:  # before Budget.charge, whose message would print a 4,000-digit size in full
            raise InvalidInput(
                f"input {name!r}: dimension {axis} is {echo(dim, 24)}, over the cap of {budget.cap} elements "
                "per request; expected a smaller tensor (split the batch across requests)"
            )
    shape, count = budget.charge(name, dims)
    parameters = _parameters_from_json(item.get("parameters"), f"input {name!r}", limit)
    size = parameters.pop("binary_data_size", None)
    if "data" in item:
        data = _from_json(name, datatype, shape, count, item["data"])
        return Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters), offset
    left = len(binary) - offset
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= left:
        raise InvalidInput(
            f"input {name!r} has neither 'data' (a JSON list) nor a binary_data_size within the "
            f"{left} binary bytes left after the JSON header"
        )
    if datatype == "BYTES":
        expected = f"at least {count * 4}"  # a 4-byte length per element
        fits = size >= count * 4
    else:
        expected = str(count * DATATYPES[datatype].itemsize)
        fits = size == count * DATATYPES[datatype].itemsize
    if not fits:
        raise InvalidInput(
            f"input {name!r}: binary_data_size is {size} bytes; expected {expected} "
            f"({count} {datatype} elements for shape {list(shape)})"
        )
    # A memoryview slice, not a copy: numeric tensors are read in place (np.frombuffer takes any buffer).
    chunk = binary[offset : offset + size]
    raw = bytes(chunk) if datatype == "BYTES" else cast(bytes, chunk)
    data = decode_raw(name, datatype, shape, count, raw)
    return Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters), offset + size


def _json_id(value: Any, limit: int) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidInput(f"request 'id' is {echo(value, limit)}; expected a string")
    if len(value) > limit:  # the id is echoed in the answer and the request log
        raise InvalidInput(f"request 'id' has {len(value)} characters; expected at most {limit}")
    return value


def _outputs_from_json(items: Any, limit: int) -> tuple[RequestedOutput, ...]:
    if items is None:
        return ()
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise InvalidInput(f"request 'outputs' is {echo(items, limit)}; expected a list of {{'name': ...}} objects")
    outputs = []
    taken: set[str] = set()
    for index, item in enumerate(items):
        name = item.get("name")
        if isinstance(name, str) and len(name) > limit:
            raise InvalidInput(
                f"requested output #{index}: name {echo(name, limit)} has {len(name)} characters; expected the "
                f"name of a model output (at most {limit} characters)"
            )
        parameters = _parameters_from_json(item.get("parameters"), f"output {echo(name, limit)}", limit)
        outputs.append(requested_output(name, index, taken, parameters))
    return tuple(outputs)


def _parameters_from_json(params: Any, where: str, limit: int = ECHO_CHARS) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise InvalidInput(f"{where}: parameters are {echo(params, limit)}; expected a JSON object")
    for key, value in params.items():
        if not isinstance(value, bool | int | float | str):
            raise InvalidInput(
                f"{where}: parameter {echo(key, limit)} is {echo(value, limit)}; expected a boolean, number or string"
            )
    return dict(params)


def _flatten(name: str, data: Any, count: int) -> list[Any]:
    """Row-major leaves of a nested list; stops early once more than ``count`` are found."""
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: data is {type(data).__name__}; expected a JSON list (flat or nested)")
    if not data or not isinstance(data[0], list):
        return data  # flat: its length says it all, nothing to copy
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
        raise InvalidInput(f"input {name!r}: {datatype} data holds {echo(bad)}; expected {_JSON_EXPECTED[kind]}")
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


_PLATFORMS = {"onnxruntime": ("onnxruntime_onnx", "onnxruntime"), "tensorrt": ("tensorrt_plan", "tensorrt")}


def config_to_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """Our ``config.json`` as the JSON of Triton's ``ModelConfig`` (``GET /v2/models/<m>/config``, what
    ``tritonclient.http``'s ``get_model_config`` returns): with batching, ``dims`` leave out the batch axis."""
    platform, backend = _PLATFORMS.get(config["platform"], (config["platform"], config["platform"]))
    batching = config.get("batching") or {}
    max_batch = int(batching.get("max_batch_size", 0))

    def tensor(spec: Mapping[str, Any]) -> dict[str, Any]:
        dims = [int(d) for d in spec["shape"]]
        datatype = str(spec["datatype"])
        return {
            "name": spec["name"],
            "data_type": "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}",
            "dims": dims[1:] if max_batch > 0 else dims,
        }

    document: dict[str, Any] = {
        "name": config["name"],
        "platform": platform,
        "backend": backend,
        "max_batch_size": max_batch,
        "input": [tensor(spec) for spec in config["inputs"]],
        "output": [tensor(spec) for spec in config["outputs"]],
        "parameters": {f"lineage.{k}": {"string_value": str(v)} for k, v in (config.get("lineage") or {}).items()},
    }
    if max_batch > 0:
        document["dynamic_batching"] = {
            "max_queue_delay_microseconds": int(batching.get("max_queue_delay_us", 0)),
            "default_queue_policy": {"max_queue_size": int(batching.get("max_queue_size", 0))},
        }
    return document


def stats_to_json(entries: Iterable[tuple[str, str, Any]]) -> dict[str, Any]:
    """Batcher counters (``serving.batching.BatcherStats``) as Triton's statistics JSON
    (``GET /v2/models/<m>[/versions/<v>]/stats``): an execution is a batch, an inference a row."""

    def duration(count: int, ns: int) -> dict[str, int]:
        return {"count": count, "ns": ns}

    return {
        "model_stats": [
            {
                "name": name,
                "version": version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.rows,
                "execution_count": s.batches,
                "inference_stats": {
                    "success": duration(s.requests - s.failures, s.queue_ns_total + s.exec_ns_total),
                    "fail": duration(s.failures + s.rejected, 0),
                    "queue": duration(s.requests, s.queue_ns_total),
                    "compute_infer": duration(s.batches, s.exec_ns_total),
                },
            }
            for name, version, s in entries
        ]
    }
