"""KServe V2 / Open Inference Protocol messages <-> the data plane's types (serving/types.py).

gRPC (``serving/proto``) and the REST JSON route of the HTTP side port both come through here, so a
request is checked once, before anything is queued: a request that converts has tensors whose data
matches their datatype and shape, within the element cap. Anything else raises ``InvalidInput`` naming
the input, what is wrong and what was expected. Also here: metadata, repository index, Triton's
ModelConfig (from our ``config.json``) and ModelStatistics, which Triton's clients and perf_analyzer read.

Wire rules (V2 spec): raw contents are little-endian and row-major, one buffer per tensor; a BYTES
element is a 4-byte little-endian length then its bytes; raw and typed contents never mix in one
message; FP16 has no typed field, so it travels raw only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from serving.errors import InvalidInput, RepositoryError
from serving.proto import grpc_service_pb2 as pb
from serving.types import (
    DATATYPES,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    Tensor,
)

Array = npt.NDArray[Any]

DEFAULT_MAX_ELEMENTS = 64 * 2**20
# numpy before 2.0 refuses more; no model we serve comes near it.
MAX_DIMS = 32

_LENGTH = struct.Struct("<I")
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
# Our platform names -> Triton's (platform, backend), which its clients and perf_analyzer expect.
_TRITON_PLATFORMS = {"onnxruntime": ("onnxruntime_onnx", "onnxruntime"), "tensorrt": ("tensorrt_plan", "tensorrt")}


def _triton_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


# --------------------------------------------------------------------------------------------------
# Checks shared by the gRPC and JSON requests
# --------------------------------------------------------------------------------------------------


class _Budget:
    """The request's element cap, spent input by input, so many small inputs cannot add up past it."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0

    def charge(self, name: str, dims: Sequence[Any]) -> tuple[tuple[int, ...], int]:
        """Validate a shape and charge its elements; returns the shape and its element count."""
        if len(dims) > MAX_DIMS:
            raise InvalidInput(f"input {name!r}: shape has {len(dims)} dimensions; expected at most {MAX_DIMS}")
        for axis, dim in enumerate(dims):
            if not isinstance(dim, int | np.integer) or isinstance(dim, bool):
                raise InvalidInput(f"input {name!r}: dimension {axis} is {dim!r}; expected an integer size")
            if dim < 0:
                raise InvalidInput(
                    f"input {name!r}: dimension {axis} of shape {list(dims)} is {dim}; expected a size >= 0 "
                    "(send the actual size, not -1)"
                )
            if dim > self.cap:
                raise InvalidInput(
                    f"input {name!r}: dimension {axis} of shape {list(dims)} is {dim}, over the cap of {self.cap} "
                    "elements per request; expected a smaller tensor (split the batch across requests)"
                )
        shape = tuple(int(d) for d in dims)
        count = math.prod(shape)
        self.used += count
        if self.used > self.cap:
            raise InvalidInput(
                f"input {name!r}: shape {list(shape)} has {count} elements, which brings the request to "
                f"{self.used}; expected at most {self.cap} in all (split the batch across requests)"
            )
        return shape, count


def _input_name(name: Any, index: int, seen: dict[str, int]) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"input #{index} has no name ({name!r}); expected the name of a model input")
    if name in seen:
        raise InvalidInput(f"input {name!r} appears twice (#{seen[name]} and #{index}); expected each input once")
    seen[name] = index
    return name


def _datatype(name: str, datatype: Any) -> str:
    if datatype not in DATATYPES:
        raise InvalidInput(
            f"input {name!r}: datatype {datatype!r} is not a V2 datatype; expected one of {', '.join(DATATYPES)}"
        )
    return str(datatype)


def _requested_output(name: Any, index: int, seen: set[str], parameters: dict[str, Any]) -> RequestedOutput:
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"requested output #{index} has no name ({name!r}); expected the name of a model output")
    if name in seen:
        raise InvalidInput(f"output {name!r} is requested twice; expected each output once")
    seen.add(name)
    return RequestedOutput(name=name, parameters=parameters)


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


def _object_array(items: Sequence[bytes]) -> Array:
    # Filled element by element: np.array() would try to read equal-length bytes as a 2-D array.
    array = np.empty(len(items), dtype=np.object_)
    for i, item in enumerate(items):
        array[i] = item
    return array


# --------------------------------------------------------------------------------------------------
# gRPC request
# --------------------------------------------------------------------------------------------------


def request_from_proto(msg: pb.ModelInferRequest, max_elements: int = DEFAULT_MAX_ELEMENTS) -> InferRequest:
    """Convert and validate a ``ModelInferRequest``.

    Args:
        msg: The request as received.
        max_elements: Cap on the elements of all inputs together.

    Returns:
        The request; ``raw_output`` is True when it used ``raw_input_contents``, unless a boolean
        ``binary_data_output`` request parameter says otherwise.

    Raises:
        InvalidInput: Unknown datatype; negative or oversized shape; element count, raw byte length or
            raw buffer count that does not match; raw and typed contents mixed; duplicate or unnamed
            inputs or outputs; a parameter without a value.
    """
    raw = msg.raw_input_contents
    names = [item.name for item in msg.inputs]
    if raw and len(raw) != len(names):
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} buffers for the {len(names)} inputs {_some(names)}; expected "
            "one buffer per input, in the order of inputs"
        )
    budget, inputs = _Budget(max_elements), []
    seen: dict[str, int] = {}
    for index, item in enumerate(msg.inputs):
        name = _input_name(item.name, index, seen)
        datatype = _datatype(name, item.datatype)
        shape, count = budget.charge(name, item.shape)
        if raw:
            typed = [field.name for field, _ in item.contents.ListFields()]
            if typed:
                raise InvalidInput(
                    f"input {name!r} has typed contents ({typed[0]}) while the request sends raw_input_contents; "
                    "expected one or the other for the whole request"
                )
            data = _from_raw(name, datatype, shape, count, raw[index])
        else:
            data = _from_contents(name, datatype, shape, count, item.contents)
        parameters = _parameters_from_proto(item.parameters, f"input {name!r}")
        inputs.append(Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters))
    outputs = []
    taken: set[str] = set()
    for index, out in enumerate(msg.outputs):
        parameters = _parameters_from_proto(out.parameters, f"output {out.name!r}")
        outputs.append(_requested_output(out.name, index, taken, parameters))
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


def _from_raw(name: str, datatype: str, shape: tuple[int, ...], count: int, buffer: bytes) -> Array:
    if datatype == "BYTES":
        return _bytes_from_raw(name, shape, count, buffer)
    dtype = DATATYPES[datatype]
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise InvalidInput(
            f"input {name!r}: raw contents are {len(buffer)} bytes; expected {expected} "
            f"({count} {datatype} elements of {dtype.itemsize} bytes for shape {list(shape)})"
        )
    if datatype == "BOOL":
        # Any non-zero byte is true; a numpy bool holding 2 would compare unequal to True.
        return np.frombuffer(buffer, dtype=np.uint8).astype(np.bool_).reshape(shape)
    # Zero-copy and read-only: the array shares the request's bytes.
    return np.frombuffer(buffer, dtype=dtype.newbyteorder("<")).reshape(shape)


def _bytes_from_raw(name: str, shape: tuple[int, ...], count: int, buffer: bytes) -> Array:
    items, offset, size = [], 0, len(buffer)
    for index in range(count):
        if offset + _LENGTH.size > size:
            raise InvalidInput(
                f"input {name!r}: raw BYTES contents end after {index} of {count} elements (shape {list(shape)}); "
                "expected each element as a 4-byte little-endian length followed by its bytes"
            )
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        if offset + length > size:
            raise InvalidInput(
                f"input {name!r}: raw BYTES element {index} declares {length} bytes but {size - offset} remain; "
                "expected each element as a 4-byte little-endian length followed by its bytes"
            )
        items.append(buffer[offset : offset + length])
        offset += length
    if offset != size:
        raise InvalidInput(
            f"input {name!r}: {size - offset} bytes left over after the {count} BYTES elements of shape "
            f"{list(shape)}; expected exactly {count} length-prefixed elements"
        )
    return _object_array(items).reshape(shape)


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
        return _object_array(list(values)).reshape(shape)
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
        flat = _flat(tensor)
        if raw:
            msg.raw_output_contents.append(_to_raw(tensor.datatype, flat))
        elif tensor.datatype == "BYTES":
            out.contents.bytes_contents.extend(_as_bytes(item) for item in flat)
        else:
            getattr(out.contents, _CONTENTS_FIELD[tensor.datatype]).extend(flat.tolist())
    return msg


def _flat(tensor: Tensor) -> Array:
    """Row-major, one-dimensional, in the wire dtype; a size that contradicts the shape is our bug."""
    if tensor.datatype not in DATATYPES:
        raise ValueError(f"output {tensor.name!r}: datatype {tensor.datatype!r} is not a V2 datatype")
    data = np.asarray(tensor.data)
    if data.size != math.prod(tensor.shape):
        raise ValueError(f"output {tensor.name!r}: {data.size} elements for shape {list(tensor.shape)}")
    if tensor.datatype == "BYTES":
        return data.reshape(-1)
    return np.ascontiguousarray(data, dtype=DATATYPES[tensor.datatype].newbyteorder("<")).reshape(-1)


def _as_bytes(item: Any) -> bytes:
    return item.encode() if isinstance(item, str) else bytes(item)


def _to_raw(datatype: str, flat: Array) -> bytes:
    if datatype != "BYTES":
        return flat.tobytes()
    parts: list[bytes] = []
    for item in flat:
        value = _as_bytes(item)
        parts += (_LENGTH.pack(len(value)), value)
    return b"".join(parts)


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


# --------------------------------------------------------------------------------------------------
# Metadata, repository, ModelConfig, ModelStatistics
# --------------------------------------------------------------------------------------------------


def server_metadata_to_proto(name: str, version: str, extensions: Iterable[str]) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(name=name, version=version, extensions=list(extensions))


def model_metadata_to_proto(meta: ModelMetadata) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=meta.name,
        versions=list(meta.versions),
        platform=meta.platform,
        inputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.inputs],
        outputs=[tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in meta.outputs],
    )


def repository_index_to_proto(entries: Iterable[RepositoryEntry]) -> pb.RepositoryIndexResponse:
    index = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[index(name=e.name, version=e.version, state=e.state, reason=e.reason) for e in entries]
    )


def model_config_to_proto(config: Mapping[str, Any]) -> pb.ModelConfig:
    """Our ``config.json`` (serving/model_format.py) as Triton's ``ModelConfig``.

    With ``batching.max_batch_size`` > 0 the first axis of every tensor is the batch axis and, as in
    Triton, ``dims`` leave it out; ``lineage`` entries become ``parameters["lineage.<key>"]`` so a client
    can tell which training run answers.

    Raises:
        RepositoryError: A tensor with an unknown datatype, or a batching model whose tensor does not
            start with the -1 batch axis.
    """
    name = str(config["name"])
    platform, backend = _TRITON_PLATFORMS.get(config["platform"], (config["platform"], config["platform"]))
    batching = config.get("batching") or {}
    max_batch = int(batching.get("max_batch_size", 0))
    msg = pb.ModelConfig(name=name, platform=platform, backend=backend, max_batch_size=max_batch)
    version = str(config.get("version", ""))
    if version.isdecimal():
        msg.version_policy.specific.versions.append(int(version))
    for spec in config["inputs"]:
        dtype, dims = _config_tensor(name, spec, max_batch)
        msg.input.add(name=spec["name"], data_type=dtype, dims=dims)
    for spec in config["outputs"]:
        dtype, dims = _config_tensor(name, spec, max_batch)
        msg.output.add(name=spec["name"], data_type=dtype, dims=dims)
    if max_batch > 0:
        msg.dynamic_batching.max_queue_delay_microseconds = int(batching.get("max_queue_delay_us", 0))
        msg.dynamic_batching.default_queue_policy.max_queue_size = int(batching.get("max_queue_size", 0))
    for key, value in (config.get("lineage") or {}).items():
        msg.parameters[f"lineage.{key}"].string_value = str(value)
    return msg


def _config_tensor(model: str, spec: Mapping[str, Any], max_batch: int) -> tuple[int, list[int]]:
    datatype, shape = spec["datatype"], [int(d) for d in spec["shape"]]
    if datatype not in DATATYPES:
        raise RepositoryError(
            f"model {model!r}: tensor {spec['name']!r} has datatype {datatype!r} in config.json; "
            f"expected one of {', '.join(DATATYPES)}"
        )
    if max_batch <= 0:
        return pb.DataType.Value(_triton_type(datatype)), shape
    if not shape or shape[0] != -1:
        raise RepositoryError(
            f"model {model!r}: tensor {spec['name']!r} has shape {shape} in config.json; with "
            f"batching.max_batch_size {max_batch} expected -1 (the batch axis) first"
        )
    return pb.DataType.Value(_triton_type(datatype)), shape[1:]


@dataclass(frozen=True)
class DurationStats:
    """``count`` events that took ``ns`` nanoseconds in all (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0


_ZERO = DurationStats()


@dataclass(frozen=True)
class BatchStats:
    """Executions of one batch size."""

    batch_size: int
    compute_infer: DurationStats = _ZERO
    compute_input: DurationStats = _ZERO
    compute_output: DurationStats = _ZERO


@dataclass(frozen=True)
class ModelVersionStats:
    """Cumulative statistics of one model version, as Triton's ModelStatistics reports them.

    ``inference_count`` counts inferences (batch rows), ``execution_count`` model executions (batches).
    The durations count requests: ``success``/``fail`` from arrival to answer, ``queue`` waiting for a
    batch, ``compute_*`` each request's share of its batch.
    """

    name: str
    version: str
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: DurationStats = _ZERO
    fail: DurationStats = _ZERO
    queue: DurationStats = _ZERO
    compute_input: DurationStats = _ZERO
    compute_infer: DurationStats = _ZERO
    compute_output: DurationStats = _ZERO
    batches: tuple[BatchStats, ...] = ()


def _duration(stats: DurationStats) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=stats.count, ns=stats.ns)


def model_statistics_to_proto(stats: Iterable[ModelVersionStats]) -> pb.ModelStatisticsResponse:
    msg = pb.ModelStatisticsResponse()
    for s in stats:
        inference = pb.InferStatistics(
            success=_duration(s.success),
            fail=_duration(s.fail),
            queue=_duration(s.queue),
            compute_input=_duration(s.compute_input),
            compute_infer=_duration(s.compute_infer),
            compute_output=_duration(s.compute_output),
        )
        batches = [
            pb.InferBatchStatistics(
                batch_size=b.batch_size,
                compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for b in s.batches
        ]
        msg.model_stats.add(
            name=s.name,
            version=s.version,
            last_inference=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            inference_stats=inference,
            batch_stats=batches,
        )
    return msg


# --------------------------------------------------------------------------------------------------
# REST JSON (the V2 HTTP route of the side port)
# --------------------------------------------------------------------------------------------------


def request_from_json(
    model_name: str, model_version: str, body: Mapping[str, Any], max_elements: int = DEFAULT_MAX_ELEMENTS
) -> InferRequest:
    """Convert and validate a V2 REST inference request body (already parsed from JSON).

    ``data`` is a flat or nested list in row-major order; BYTES elements are strings (sent as UTF-8).
    Binary tensor data (Triton's binary extension) is not accepted on this route: use gRPC.

    Raises:
        InvalidInput: As for :func:`request_from_proto`, plus a body of the wrong JSON shape or values of
            the wrong JSON type for the datatype.
    """
    if not isinstance(body, Mapping):
        raise InvalidInput(f"request body is {type(body).__name__}; expected a JSON object")
    items = body.get("inputs")
    if not isinstance(items, list):
        raise InvalidInput(f"request 'inputs' is {items!r}; expected a list of input objects")
    budget, inputs = _Budget(max_elements), []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidInput(
                f"input #{index} is {type(item).__name__}; expected an object with name, shape, datatype, data"
            )
        name = _input_name(item.get("name"), index, seen)
        datatype = _datatype(name, item.get("datatype"))
        dims = item.get("shape")
        if not isinstance(dims, list):
            raise InvalidInput(f"input {name!r}: shape is {dims!r}; expected a list of sizes")
        shape, count = budget.charge(name, dims)
        if "data" not in item:
            raise InvalidInput(
                f"input {name!r} has no 'data'; expected a JSON list "
                "(binary tensor data is not supported on this route: use gRPC)"
            )
        data = _from_json(name, datatype, shape, count, item["data"])
        parameters = _parameters_from_json(item.get("parameters"), f"input {name!r}")
        inputs.append(Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=parameters))
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        id=_json_id(body.get("id")),
        inputs=tuple(inputs),
        outputs=_outputs_from_json(body.get("outputs")),
        parameters=_parameters_from_json(body.get("parameters"), "request"),
        raw_output=False,
    )


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
        outputs.append(_requested_output(item.get("name"), index, taken, parameters))
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
        return _object_array([v.encode() for v in leaves]).reshape(shape)
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


def response_to_json(resp: InferResponse) -> dict[str, Any]:
    """A V2 REST inference response body; BYTES outputs become UTF-8 strings.

    Raises:
        InvalidInput: A BYTES output is not UTF-8 text, so JSON cannot carry it (the gRPC route can).
    """
    body: dict[str, Any] = {
        "model_name": resp.model_name,
        "model_version": resp.model_version,
        "outputs": [_output_json(tensor) for tensor in resp.outputs],
    }
    if resp.id:
        body["id"] = resp.id
    if resp.parameters:
        body["parameters"] = _json_parameters(resp.parameters)
    return body


def _output_json(tensor: Tensor) -> dict[str, Any]:
    flat = _flat(tensor)
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


def _json_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    # numpy scalars are not JSON serialisable; .item() gives the Python value.
    return {key: value.item() if isinstance(value, np.generic) else value for key, value in params.items()}
