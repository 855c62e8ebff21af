"""serving/grpc_api/converters.py under hypothesis: anything a client can send either converts or is refused
with InvalidInput, and whatever converts can be answered and reads back the same."""

from __future__ import annotations

import math
import struct
from collections.abc import MutableMapping
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.codec import DEFAULT_MAX_ELEMENTS
from serving.errors import InvalidInput
from serving.grpc_api import converters
from serving.proto import grpc_service_pb2 as pb
from serving.types import (
    DATATYPES,
    InferRequest,
    InferResponse,
)
from tests.serving.wire import CONTENTS_FIELD, as_request

# --- fuzz: converts or refuses with InvalidInput, never anything else --------------------------------

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=6),
}


def _mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` nine times in ten: hostile values everywhere would refuse every request at the first check."""
    return st.integers(0, 9).flatmap(lambda n: good if n else bad)


HOSTILE_NAMES = st.sampled_from(["", "a"]) | st.text(max_size=3)
DATATYPE_NAMES = _mostly(st.sampled_from(list(DATATYPES)), st.sampled_from(["BF16", "FLOAT", "", "fp32"]))
DIMS = _mostly(st.integers(0, 4), st.integers(-2, -1) | st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)]))
SHAPES = _mostly(st.lists(DIMS, max_size=4), st.lists(st.just(1), min_size=30, max_size=40))
PARAMETER_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool_param": st.booleans(),
    "int64_param": st.integers(-(2**63), 2**63 - 1),
    "string_param": st.text(max_size=3),
    "double_param": st.floats(),
    "uint64_param": st.integers(0, 2**64 - 1),
}


def _elements(shape: list[int]) -> int | None:
    """Element count of a shape small enough to fill, else None."""
    if any(d < 0 or d > 64 for d in shape):
        return None
    count = math.prod(shape)
    return count if count <= 64 else None


def _draw_parameters(draw: st.DrawFn, params: MutableMapping[str, pb.InferParameter]) -> None:
    for key in draw(st.lists(st.sampled_from(["k", "binary_data_output", "p"]), max_size=2, unique=True)):
        choice = draw(_mostly(st.sampled_from(list(PARAMETER_VALUES)), st.just("none")))
        if choice == "none":
            params[key].Clear()  # present, with no value
        else:
            setattr(params[key], choice, draw(PARAMETER_VALUES[choice]))


def _draw_raw(draw: st.DrawFn, datatype: str, shape: list[int]) -> bytes:
    count = _elements(shape)
    if count is None or datatype not in DATATYPES or draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=5), min_size=count, max_size=count))
        return b"".join(struct.pack("<I", len(item)) + item for item in items)
    size = count * DATATYPES[datatype].itemsize
    return draw(st.binary(min_size=size, max_size=size))


def _draw_contents(draw: st.DrawFn, contents: pb.InferTensorContents, datatype: str, shape: list[int]) -> None:
    count = _elements(shape)
    right = CONTENTS_FIELD.get(datatype)
    field = right if right and draw(st.integers(0, 9)) else draw(st.sampled_from(sorted(FIELD_VALUES)))
    size = count if count is not None and draw(st.integers(0, 9)) else draw(st.integers(0, 5))
    getattr(contents, field).extend(draw(st.lists(FIELD_VALUES[field], min_size=size, max_size=size)))


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=draw(st.text(max_size=3)), id=draw(st.text(max_size=3)))
    raw = draw(st.booleans())
    for index in range(draw(st.integers(0, 3))):
        name = draw(_mostly(st.just(f"in{index}"), HOSTILE_NAMES))
        item = msg.inputs.add(name=name, datatype=draw(DATATYPE_NAMES), shape=draw(SHAPES))
        if raw:
            msg.raw_input_contents.append(_draw_raw(draw, item.datatype, list(item.shape)))
        if not raw or draw(st.integers(0, 9)) == 0:
            _draw_contents(draw, item.contents, item.datatype, list(item.shape))
        _draw_parameters(draw, item.parameters)
    if raw and draw(st.integers(0, 9)) == 0:
        msg.raw_input_contents.append(b"")  # one buffer too many
    for index in range(draw(st.integers(0, 2))):
        name = draw(_mostly(st.just(f"out{index}"), HOSTILE_NAMES))
        _draw_parameters(draw, msg.outputs.add(name=name).parameters)
    _draw_parameters(draw, msg.parameters)
    return msg


def _converts_or_refuses(msg: pb.ModelInferRequest, max_elements: int = DEFAULT_MAX_ELEMENTS) -> InferRequest | None:
    try:
        request = converters.request_from_proto(msg, max_elements=max_elements)
    except InvalidInput as exc:
        assert str(exc)
        return None
    for tensor in request.inputs:
        assert tensor.data.shape == tensor.shape
        assert tensor.data.dtype == DATATYPES[tensor.datatype]
    return request


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        msg = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        return
    _converts_or_refuses(msg)


@FUZZ
@given(infer_requests(), st.booleans())
def test_fuzz_structured_requests(msg: pb.ModelInferRequest, raw: bool) -> None:
    request = _converts_or_refuses(msg, max_elements=1000)
    if request is None:
        return
    # Whatever is accepted can be answered, and reads back the same.
    answer = converters.response_to_proto(
        InferResponse("m", "1", request.id, request.inputs, request.parameters), raw=raw
    )
    again = converters.request_from_proto(as_request(answer))
    for before, after in zip(request.inputs, again.inputs, strict=True):
        assert (before.name, before.datatype, before.shape) == (after.name, after.datatype, after.shape)
        if before.datatype == "BYTES":
            assert before.data.tolist() == after.data.tolist()
        else:
            np.testing.assert_array_equal(before.data, after.data)
