"""serving/converters.py, converters_json.py, converters_meta.py and tensor_checks.py: every V2 datatype
both ways, typed and raw, gRPC and JSON; each refusal names the input and what was expected; metadata,
ModelConfig and statistics; and a fuzz test that anything a client can send either converts or is
refused with InvalidInput."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import serialize_byte_tensor

from serving import converters, converters_json, converters_meta
from serving.errors import InvalidInput, RepositoryError
from serving.proto import grpc_service_pb2 as pb
from serving.tensor_checks import DEFAULT_MAX_ELEMENTS
from serving.types import (
    DATATYPES,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    Tensor,
    TensorMetadata,
)

# The V2 spec's typed field per datatype; FP16 has none and travels raw only.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    **dict.fromkeys(["INT8", "INT16", "INT32"], "int_contents"),
    "INT64": "int64_contents",
    **dict.fromkeys(["UINT8", "UINT16", "UINT32"], "uint_contents"),
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([[0, 1, 255], [7, 8, 9]], dtype=np.uint8),
    "UINT16": np.array([[0, 1, 65535], [7, 8, 9]], dtype=np.uint16),
    "UINT32": np.array([[0, 1, 2**32 - 1], [7, 8, 9]], dtype=np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1], [7, 8, 9]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127], [-1, 8, 9]], dtype=np.int8),
    "INT16": np.array([[-(2**15), 0, 2**15 - 1], [-1, 8, 9]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1], [-1, 8, 9]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1], [-1, 8, 9]], dtype=np.int64),
    "FP16": np.array([[0.5, -2.0, 65504.0], [np.inf, -0.0, 1e-3]], dtype=np.float16),
    "FP32": np.array([[0.5, -2.0, 3.4e38], [np.inf, np.nan, 1e-30]], dtype=np.float32),
    "FP64": np.array([[0.5, -2.0, 1e308], [-np.inf, np.nan, 5e-324]], dtype=np.float64),
    "BYTES": np.array([[b"", b"defect", b"\x00\xff"], [b"a", "güt".encode(), b"x" * 300]], dtype=np.object_),
}
TYPED = [dt for dt in ARRAYS if dt != "FP16"]


def _raw(datatype: str, array: np.ndarray[Any, Any]) -> bytes:
    """The V2 raw encoding, written independently of the code under test (BYTES by tritonclient)."""
    if datatype == "BYTES":
        return bytes(serialize_byte_tensor(array).item()) if array.size else b""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _request(tensors: dict[str, tuple[str, np.ndarray[Any, Any]]], raw: bool) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="pcb", model_version="1", id="req-7")
    for name, (datatype, array) in tensors.items():
        item = msg.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            msg.raw_input_contents.append(_raw(datatype, array))
        else:
            getattr(item.contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
    return msg


def _as_request(response: pb.ModelInferResponse) -> pb.ModelInferRequest:
    """A response re-read as a request: InferOutputTensor and InferInputTensor share fields 1-5 on the wire."""
    msg = pb.ModelInferRequest(model_name=response.model_name, id=response.id)
    for out in response.outputs:
        msg.inputs.add().MergeFromString(out.SerializeToString())
    msg.raw_input_contents.extend(response.raw_output_contents)
    return msg


def _assert_same(tensor: Tensor, datatype: str, array: np.ndarray[Any, Any]) -> None:
    assert (tensor.datatype, tensor.shape) == (datatype, array.shape)
    assert tensor.data.shape == array.shape
    assert tensor.data.dtype == DATATYPES[datatype]
    if datatype == "BYTES":
        assert tensor.data.tolist() == array.tolist()
    else:
        np.testing.assert_array_equal(tensor.data, array)


# --- round trips, every datatype -----------------------------------------------------------------


@pytest.mark.parametrize("datatype", TYPED)
def test_typed_request_every_datatype(datatype: str) -> None:
    request = converters.request_from_proto(_request({"x": (datatype, ARRAYS[datatype])}, raw=False))
    (tensor,) = request.inputs
    _assert_same(tensor, datatype, ARRAYS[datatype])
    assert (request.model_name, request.model_version, request.id, request.raw_output) == ("pcb", "1", "req-7", False)


@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_raw_request_every_datatype(datatype: str) -> None:
    request = converters.request_from_proto(_request({"x": (datatype, ARRAYS[datatype])}, raw=True))
    _assert_same(request.inputs[0], datatype, ARRAYS[datatype])
    assert request.raw_output is True


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_response_round_trip_every_datatype(datatype: str, raw: bool) -> None:
    array = ARRAYS[datatype]
    response = InferResponse("pcb", "1", "req-7", (Tensor("y", datatype, array.shape, array),))
    msg = converters.response_to_proto(response, raw=raw)
    # FP16 has no typed field, so it makes the whole response raw.
    assert len(msg.raw_output_contents) == (1 if raw or datatype == "FP16" else 0)
    if msg.raw_output_contents:
        assert msg.raw_output_contents[0] == _raw(datatype, array)
    (tensor,) = converters.request_from_proto(_as_request(msg)).inputs
    _assert_same(tensor, datatype, array)


def test_one_fp16_output_makes_the_whole_response_raw() -> None:
    outputs = (Tensor("a", "FP32", (1,), np.ones(1, np.float32)), Tensor("b", "FP16", (1,), np.ones(1, np.float16)))
    msg = converters.response_to_proto(InferResponse("m", "1", "", outputs), raw=False)
    assert len(msg.raw_output_contents) == 2
    assert not msg.outputs[0].contents.ListFields()


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("datatype", ["FP32", "BYTES", "BOOL"])
def test_empty_tensors(datatype: str, raw: bool) -> None:
    array = np.empty((0, 3), dtype=DATATYPES[datatype])
    (tensor,) = converters.request_from_proto(_request({"x": (datatype, array)}, raw=raw)).inputs
    _assert_same(tensor, datatype, array)


def test_many_inputs_keep_their_order_and_buffers() -> None:
    tensors = {f"in{i}": (dt, ARRAYS[dt]) for i, dt in enumerate(ARRAYS)}
    request = converters.request_from_proto(_request(tensors, raw=True))
    for tensor, (name, (datatype, array)) in zip(request.inputs, tensors.items(), strict=True):
        assert tensor.name == name
        _assert_same(tensor, datatype, array)


def test_raw_bool_reads_any_nonzero_byte_as_true() -> None:
    msg = pb.ModelInferRequest(raw_input_contents=[b"\x00\x01\x02\xff"])
    msg.inputs.add(name="mask", datatype="BOOL", shape=[4])
    assert converters.request_from_proto(msg).inputs[0].data.tolist() == [False, True, True, True]


# --- parameters, requested outputs, raw_output -----------------------------------------------------


def _set(params: MutableMapping[str, pb.InferParameter], **values: tuple[str, Any]) -> None:
    for key, (field, value) in values.items():
        setattr(params[key], field, value)


def test_parameters_of_every_kind_at_every_level() -> None:
    msg = _request({"x": ("FP32", ARRAYS["FP32"])}, raw=True)
    _set(
        msg.parameters,
        b=("bool_param", True),
        i=("int64_param", -(2**63)),
        s=("string_param", "canary"),
        d=("double_param", 0.25),
        u=("uint64_param", 2**64 - 1),
    )
    _set(msg.inputs[0].parameters, layout=("string_param", "NCHW"))
    out = msg.outputs.add(name="logits")
    _set(out.parameters, classification=("int64_param", 3))

    request = converters.request_from_proto(msg)
    assert request.parameters == {"b": True, "i": -(2**63), "s": "canary", "d": 0.25, "u": 2**64 - 1}
    assert request.inputs[0].parameters == {"layout": "NCHW"}
    assert [(o.name, o.parameters) for o in request.outputs] == [("logits", {"classification": 3})]


def test_response_parameters_take_the_matching_field() -> None:
    params = {"b": np.bool_(True), "i": -5, "big": 2**64 - 1, "n": np.int32(7), "f": np.float32(0.5), "s": "x"}
    msg = converters.response_to_proto(InferResponse("m", "1", "", (), parameters=params), raw=True)
    chosen = {
        k: (v.WhichOneof("parameter_choice"), getattr(v, v.WhichOneof("parameter_choice")))
        for k, v in msg.parameters.items()
    }
    assert chosen == {
        "b": ("bool_param", True),
        "i": ("int64_param", -5),
        "big": ("uint64_param", 2**64 - 1),
        "n": ("int64_param", 7),
        "f": ("double_param", 0.5),
        "s": ("string_param", "x"),
    }


@pytest.mark.parametrize("value", [[1, 2], None, 2**64, b"raw"])
def test_a_response_parameter_protobuf_cannot_carry_is_our_bug(value: Any) -> None:
    with pytest.raises(TypeError, match="response: parameter 'p'"):
        converters.response_to_proto(InferResponse("m", "1", "", (), parameters={"p": value}), raw=True)


@pytest.mark.parametrize(
    ("raw", "binary_data_output", "expected"),
    [(True, None, True), (False, None, False), (False, True, True), (True, False, False)],
)
def test_raw_output_follows_the_request_unless_asked(
    raw: bool, binary_data_output: bool | None, expected: bool
) -> None:
    msg = _request({"x": ("FP32", ARRAYS["FP32"])}, raw=raw)
    if binary_data_output is not None:
        msg.parameters["binary_data_output"].bool_param = binary_data_output
    assert converters.request_from_proto(msg).raw_output is expected


# --- every refusal names the input and the expected value --------------------------------------------

Mutation = Callable[[pb.ModelInferRequest], None]


def _base() -> pb.ModelInferRequest:
    """``image`` FP32 [2, 3] and ``mask`` BOOL [2], raw."""
    return _request({"image": ("FP32", ARRAYS["FP32"]), "mask": ("BOOL", np.array([True, False]))}, raw=True)


def _typed_base() -> pb.ModelInferRequest:
    return _request({"image": ("FP32", ARRAYS["FP32"]), "mask": ("BOOL", np.array([True, False]))}, raw=False)


def _bytes_input(raw: bytes, shape: tuple[int, ...] = (2,)) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(raw_input_contents=[raw])
    msg.inputs.add(name="text", datatype="BYTES", shape=shape)
    return msg


def _typed_input(datatype: str, field: str, values: list[Any], shape: tuple[int, ...]) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest()
    getattr(msg.inputs.add(name="small", datatype=datatype, shape=shape).contents, field).extend(values)
    return msg


def _with(make: Callable[[], pb.ModelInferRequest], change: Mutation) -> pb.ModelInferRequest:
    msg = make()
    change(msg)
    return msg


def _set_shape(index: int, shape: list[int]) -> Mutation:
    def change(msg: pb.ModelInferRequest) -> None:
        del msg.inputs[index].shape[:]
        msg.inputs[index].shape.extend(shape)

    return change


REFUSALS: dict[str, tuple[pb.ModelInferRequest, str]] = {
    "unknown datatype": (
        _with(_base, lambda m: setattr(m.inputs[0], "datatype", "FLOAT32")),
        "input 'image': datatype 'FLOAT32' is not a V2 datatype; expected one of BOOL, UINT8",
    ),
    "negative dimension": (
        _with(_base, _set_shape(0, [-1, 3])),
        r"input 'image': dimension 0 of shape \[-1, 3\] is -1; expected a size >= 0",
    ),
    "too many dimensions": (
        _with(_base, _set_shape(0, [1] * 33)),
        "input 'image': shape has 33 dimensions; expected at most 32",
    ),
    "typed count": (
        _with(_typed_base, lambda m: m.inputs[0].contents.fp32_contents.pop()),
        r"input 'image': 5 FP32 elements in contents.fp32_contents for shape \[2, 3\]; expected 6",
    ),
    "raw byte length": (
        _with(_base, _set_shape(0, [2, 2])),
        r"input 'image': raw contents are 24 bytes; expected 16 \(4 FP32 elements of 4 bytes for shape \[2, 2\]\)",
    ),
    "raw and typed": (
        _with(_base, lambda m: m.inputs[1].contents.bool_contents.extend([True, False])),
        r"input 'mask' has typed contents \(bool_contents\) while the request sends raw_input_contents; expected one",
    ),
    "raw buffer count": (
        _with(_base, lambda m: m.raw_input_contents.pop()),
        r"raw_input_contents has 1 buffers for the 2 inputs \['image', 'mask'\]; expected one buffer per input",
    ),
    "duplicate input": (
        _with(_base, lambda m: setattr(m.inputs[1], "name", "image")),
        r"input 'image' appears twice \(#0 and #1\); expected each input once",
    ),
    "unnamed input": (
        _with(_base, lambda m: setattr(m.inputs[1], "name", "")),
        "input #1 has no name",
    ),
    "wrong typed field": (
        _typed_input("FP32", "fp64_contents", [1.0], (1,)),
        "input 'small': FP32 data sent in fp64_contents; expected fp32_contents",
    ),
    "value out of range": (
        _typed_input("INT8", "int_contents", [1, 300], (2,)),
        r"input 'small': value 300 is out of range for INT8; expected -128\.\.127",
    ),
    "negative for unsigned": (
        _typed_input("UINT16", "uint_contents", [70000], (1,)),
        r"input 'small': value 70000 is out of range for UINT16; expected 0\.\.65535",
    ),
    "FP16 typed": (
        _typed_input("FP16", "fp32_contents", [1.0], (1,)),
        r"input 'small': FP16 data sent in fp32_contents; expected raw_input_contents \(FP16 has no typed field\)",
    ),
    "FP16 without raw": (
        _typed_input("FP16", "fp32_contents", [], (1,)),
        "input 'small': no data for shape \\[1\\]; expected 1 FP16 elements in raw_input_contents",
    ),
    "BYTES length cut short": (
        _bytes_input(struct.pack("<I", 1) + b"a" + b"\x02\x00"),
        "input 'text': raw BYTES contents end after 1 of 2 elements",
    ),
    "BYTES element overruns": (
        _bytes_input(struct.pack("<I", 1) + b"a" + struct.pack("<I", 9) + b"abc"),
        "input 'text': raw BYTES element 1 declares 9 bytes but 3 remain",
    ),
    "BYTES trailing bytes": (
        _bytes_input(struct.pack("<I", 1) + b"a" + struct.pack("<I", 0) + b"zz"),
        r"input 'text': 2 bytes left over after the 2 BYTES elements of shape \[2\]",
    ),
    "parameter without value": (
        _with(_base, lambda m: m.inputs[0].parameters["layout"].Clear()),
        "input 'image': parameter 'layout' has no value; expected one of bool_param",
    ),
    "output requested twice": (
        _with(_base, lambda m: m.outputs.extend([pb.ModelInferRequest.InferRequestedOutputTensor(name="logits")] * 2)),
        "output 'logits' is requested twice",
    ),
    "unnamed output": (
        _with(_base, lambda m: m.outputs.add()),
        "requested output #0 has no name",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_names_the_input_and_the_expectation(case: str) -> None:
    msg, message = REFUSALS[case]
    with pytest.raises(InvalidInput, match=message):
        converters.request_from_proto(msg)


def test_the_element_cap_counts_every_input() -> None:
    # image has 6 elements, mask 2: 8 in all.
    converters.request_from_proto(_base(), max_elements=8)
    with pytest.raises(
        InvalidInput,
        match=r"input 'mask': shape \[2\] has 2 elements, which brings the request to 8; expected at most 7",
    ):
        converters.request_from_proto(_base(), max_elements=7)


def test_a_huge_dimension_is_refused_even_beside_a_zero() -> None:
    msg = _with(_base, _set_shape(0, [0, 2**62]))
    with pytest.raises(
        InvalidInput,
        match=r"input 'image': dimension 1 of shape \[0, 4611686018427387904\] is 4611686018427387904, over the cap",
    ):
        converters.request_from_proto(msg)


# --- JSON (the REST route) ---------------------------------------------------------------------------


JSON_ARRAYS = {
    **{dt: a for dt, a in ARRAYS.items() if dt not in ("BYTES", "FP32", "FP64", "FP16")},
    "FP16": np.array([[0.5, -2.0, 65504.0], [1.0, -0.0, 1e-3]], dtype=np.float16),
    "FP32": np.array([[0.5, -2.0, 3.4e38], [1.0, 0.0, 1e-30]], dtype=np.float32),
    "FP64": np.array([[0.5, -2.0, 1e308], [-1.0, 0.0, 5e-324]], dtype=np.float64),
    "BYTES": np.array([["", "défaut", "ok"], ["a", "b", "c"]], dtype=np.object_),
}


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("datatype", list(JSON_ARRAYS))
def test_json_request_and_response_every_datatype(datatype: str, nested: bool) -> None:
    array = JSON_ARRAYS[datatype]
    data = array.tolist() if nested else array.reshape(-1).tolist()
    body = {"id": "j1", "inputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": data}]}
    request = converters_json.request_from_json("pcb", "2", body)
    expected = (
        np.array([[v.encode() for v in row] for row in array.tolist()], dtype=object) if datatype == "BYTES" else array
    )
    _assert_same(request.inputs[0], datatype, expected)
    assert (request.model_name, request.model_version, request.id, request.raw_output) == ("pcb", "2", "j1", False)

    answer = converters_json.response_to_json(InferResponse("pcb", "2", "j1", request.inputs, {"n": np.int64(3)}))
    assert answer == {
        "model_name": "pcb",
        "model_version": "2",
        "id": "j1",
        "parameters": {"n": 3},
        "outputs": [{"name": "x", "datatype": datatype, "shape": [2, 3], "data": array.reshape(-1).tolist()}],
    }


def test_json_outputs_and_parameters() -> None:
    body = {
        "inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [1], "parameters": {"layout": "N"}}],
        "outputs": [{"name": "logits", "parameters": {"classification": 2}}, {"name": "probs"}],
        "parameters": {"priority": 1, "tag": "a", "flag": False, "ratio": 0.5},
    }
    request = converters_json.request_from_json("pcb", "", body)
    assert request.inputs[0].parameters == {"layout": "N"}
    assert [(o.name, o.parameters) for o in request.outputs] == [("logits", {"classification": 2}), ("probs", {})]
    assert request.parameters == {"priority": 1, "tag": "a", "flag": False, "ratio": 0.5}
    assert request.id == ""


def _json_input(**fields: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "INT32", "shape": [2, 2], "data": [[1, 2], [3, 4]], **fields}]}


JSON_REFUSALS: dict[str, tuple[Any, str]] = {
    "body not an object": ([1], "request body is list; expected a JSON object"),
    "no inputs": ({}, "request 'inputs' is None; expected a list of input objects"),
    "input not an object": ({"inputs": [3]}, "input #0 is int; expected an object"),
    "unnamed": ({"inputs": [{"datatype": "INT32", "shape": [1], "data": [1]}]}, "input #0 has no name"),
    "unknown datatype": (_json_input(datatype="int"), "input 'x': datatype 'int' is not a V2 datatype"),
    "shape not a list": (_json_input(shape=4), "input 'x': shape is 4; expected a list of sizes"),
    "shape of floats": (_json_input(shape=[2.0, 2]), "input 'x': dimension 0 is 2.0; expected an integer size"),
    "negative shape": (_json_input(shape=[-1, 2]), "input 'x': dimension 0 of shape \\[-1, 2\\] is -1"),
    "no data": (
        {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1]}]},
        r"input 'x' has neither 'data' \(a JSON list\) nor a binary_data_size",
    ),
    "data not a list": (_json_input(data="1234"), "input 'x': data is str; expected a JSON list"),
    "too few": (_json_input(data=[[1, 2], [3]]), r"input 'x': 3 INT32 elements in data for shape \[2, 2\]; expected 4"),
    "too many": (
        _json_input(data=[1, 2, 3, 4, 5, 6]),
        r"input 'x': more than 4 INT32 elements in data for shape \[2, 2\]; expected 4",
    ),
    "float for an int": (_json_input(data=[1, 2, 3, 4.5]), "input 'x': INT32 data holds 4.5; expected integers"),
    "bool for an int": (_json_input(data=[1, 2, 3, True]), "input 'x': INT32 data holds True; expected integers"),
    "int out of range": (
        _json_input(data=[1, 2, 3, 2**31]),
        r"input 'x': value 2147483648 is out of range for INT32; expected -2147483648\.\.2147483647",
    ),
    "number for a bool": (
        _json_input(datatype="BOOL", data=[1, 0, 1, 0]),
        "input 'x': BOOL data holds 1; expected true or false",
    ),
    "string for a float": (
        _json_input(datatype="FP32", data=[1, 2, 3, "4"]),
        "input 'x': FP32 data holds '4'; expected numbers",
    ),
    "float overflow": (
        _json_input(datatype="FP16", data=[1, 2, 3, 1e6]),
        "input 'x': value 1e\\+06 is out of range for FP16; expected at most 65504",
    ),
    "int beyond any float": (
        _json_input(datatype="FP64", data=[1, 2, 3, 10**400]),
        "input 'x': a value is out of range for FP64",
    ),
    "number for BYTES": (
        _json_input(datatype="BYTES", data=["a", "b", "c", 4]),
        "input 'x': BYTES data holds 4; expected strings",
    ),
    "nested parameters": (
        _json_input(parameters={"p": [1]}),
        r"input 'x': parameter 'p' is \[1\]; expected a boolean, number or string",
    ),
    "parameters not an object": (
        _json_input(parameters=[1]),
        r"input 'x': parameters are \[1\]; expected a JSON object",
    ),
    "id not a string": (_json_input() | {"id": 5}, "request 'id' is 5; expected a string"),
    "outputs not objects": (
        _json_input() | {"outputs": ["logits"]},
        "request 'outputs' is \\['logits'\\]; expected a list",
    ),
    "output twice": (_json_input() | {"outputs": [{"name": "y"}, {"name": "y"}]}, "output 'y' is requested twice"),
    "duplicate input": (
        {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [1]}] * 2},
        r"input 'x' appears twice \(#0 and #1\)",
    ),
}


@pytest.mark.parametrize("case", list(JSON_REFUSALS))
def test_each_json_refusal_names_the_problem(case: str) -> None:
    body, message = JSON_REFUSALS[case]
    with pytest.raises(InvalidInput, match=message):
        converters_json.request_from_json("pcb", "", body)


def test_json_element_cap() -> None:
    with pytest.raises(
        InvalidInput,
        match=r"input 'x': shape \[2, 2\] has 4 elements, which brings the request to 4; expected at most 3",
    ):
        converters_json.request_from_json("pcb", "", _json_input(), max_elements=3)


def test_a_bytes_output_json_cannot_carry_is_refused_by_name() -> None:
    output = Tensor("blob", "BYTES", (2,), np.array([b"ok", b"\xff\xfe"], dtype=object))
    with pytest.raises(
        InvalidInput, match="output 'blob': element 1 is not UTF-8 text, which JSON cannot carry; request it over gRPC"
    ):
        converters_json.response_to_json(InferResponse("m", "1", "", (output,)))


# --- metadata, repository, ModelConfig, statistics ----------------------------------------------------


def test_server_and_model_metadata() -> None:
    server = converters_meta.server_metadata_to_proto("sluicegate", "0.1.0", ["model_repository", "statistics"])
    assert (server.name, server.version, list(server.extensions)) == (
        "sluicegate",
        "0.1.0",
        ["model_repository", "statistics"],
    )

    meta = ModelMetadata(
        "pcb",
        ("1", "2"),
        "onnxruntime_onnx",
        (TensorMetadata("image", "FP32", (-1, 3, 224, 224)),),
        (TensorMetadata("logits", "FP32", (-1, 2)), TensorMetadata("label", "BYTES", (-1,))),
    )
    msg = converters_meta.model_metadata_to_proto(meta)
    assert (msg.name, list(msg.versions), msg.platform) == ("pcb", ["1", "2"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in msg.inputs] == [("image", "FP32", [-1, 3, 224, 224])]
    assert [(t.name, t.datatype, list(t.shape)) for t in msg.outputs] == [
        ("logits", "FP32", [-1, 2]),
        ("label", "BYTES", [-1]),
    ]


def test_repository_index() -> None:
    entries = [RepositoryEntry("pcb", "1", "READY"), RepositoryEntry("pcb", "2", "UNAVAILABLE", "checksum mismatch")]
    msg = converters_meta.repository_index_to_proto(entries)
    assert [(m.name, m.version, m.state, m.reason) for m in msg.models] == [
        ("pcb", "1", "READY", ""),
        ("pcb", "2", "UNAVAILABLE", "checksum mismatch"),
    ]


def _config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "pcb",
        "version": "4",
        "platform": "tensorrt",
        "inputs": [{"name": "image", "datatype": "FP16", "shape": [-1, 3, 64, 64]}],
        "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "tag", "datatype": "BYTES", "shape": [-1]},
        ],
        "batching": {"max_batch_size": 16, "max_queue_delay_us": 0, "max_queue_size": 32},
    }
    return config | changes


def test_model_config_of_a_batching_model() -> None:
    msg = converters_meta.model_config_to_proto(_config())
    assert (msg.name, msg.platform, msg.backend, msg.max_batch_size) == ("pcb", "tensorrt_plan", "tensorrt", 16)
    assert [(t.name, t.data_type, list(t.dims)) for t in msg.input] == [("image", pb.TYPE_FP16, [3, 64, 64])]
    assert [(t.name, t.data_type, list(t.dims)) for t in msg.output] == [
        ("logits", pb.TYPE_FP32, [2]),
        ("tag", pb.TYPE_STRING, []),
    ]
    assert msg.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert msg.dynamic_batching.max_queue_delay_microseconds == 0
    assert msg.dynamic_batching.default_queue_policy.max_queue_size == 32
    assert list(msg.version_policy.specific.versions) == [4]


def test_model_config_without_batching_keeps_full_shapes() -> None:
    msg = converters_meta.model_config_to_proto(
        _config(batching={"max_batch_size": 0}, platform="rules", version="v-a")
    )
    assert (msg.platform, msg.backend, msg.max_batch_size) == ("rules", "rules", 0)
    assert list(msg.input[0].dims) == [-1, 3, 64, 64]
    assert msg.WhichOneof("scheduling_choice") is None
    assert not msg.HasField("version_policy")


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_model_config_datatypes_are_tritons(datatype: str) -> None:
    config = _config(inputs=[{"name": "x", "datatype": datatype, "shape": [-1]}])
    expected = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
    assert pb.DataType.Name(converters_meta.model_config_to_proto(config).input[0].data_type) == expected


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            {"name": "image", "datatype": "FP32", "shape": [1, 3]},
            r"tensor 'image' has shape \[1, 3\] in config.json; with batching.max_batch_size 16 expected -1",
        ),
        ({"name": "image", "datatype": "FLOAT", "shape": [-1]}, "tensor 'image' has datatype 'FLOAT' in config.json"),
    ],
)
def test_model_config_refuses_what_triton_could_not_describe(tensor: dict[str, Any], message: str) -> None:
    with pytest.raises(RepositoryError, match=message):
        converters_meta.model_config_to_proto(_config(inputs=[tensor]))


def test_model_statistics_defaults_are_zero() -> None:
    assert not converters_meta.model_statistics_to_proto([]).model_stats
    (stats,) = converters_meta.model_statistics_to_proto([converters_meta.ModelVersionStats("pcb", "1")]).model_stats
    assert (stats.name, stats.version, stats.inference_count, stats.inference_stats.success.count) == ("pcb", "1", 0, 0)
    assert stats.HasField("inference_stats") and not stats.batch_stats


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
    again = converters.request_from_proto(_as_request(answer))
    for before, after in zip(request.inputs, again.inputs, strict=True):
        assert (before.name, before.datatype, before.shape) == (after.name, after.datatype, after.shape)
        if before.datatype == "BYTES":
            assert before.data.tolist() == after.data.tolist()
        else:
            np.testing.assert_array_equal(before.data, after.data)


def test_messages_name_the_input_not_the_whole_request() -> None:
    # A status message travels in a gRPC trailer: long names are cut, and only a few are listed.
    msg = pb.ModelInferRequest(raw_input_contents=[b""])
    for i in range(20):
        msg.inputs.add(name=f"input_{i}_" + "x" * 200, datatype="FP32", shape=[0])
    with pytest.raises(InvalidInput) as caught:
        converters.request_from_proto(msg)
    assert len(str(caught.value)) < 1000 and re.search(r"'input_0_x+', .*, \.\.\.\]", str(caught.value))


def test_json_with_binary_tensor_data_round_trips() -> None:
    """Triton's binary extension, as KServe's REST client sends it by default."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    words = np.array([b"ab", b""], dtype=np.object_)
    raw_words = b"".join(struct.pack("<I", len(w)) + w for w in words)
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [3, 4], "parameters": {"binary_data_size": x.nbytes}},
            {"name": "w", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(raw_words)}},
        ],
        "parameters": {"binary_data_output": True},
    }
    request = converters_json.request_from_json("m", "", body, binary=x.tobytes() + raw_words)
    np.testing.assert_array_equal(request.inputs[0].data, x)
    assert list(request.inputs[1].data) == [b"ab", b""] and request.raw_output
    assert "binary_data_size" not in request.inputs[0].parameters
    with pytest.raises(InvalidInput, match="4 binary bytes after the JSON header belong to no input"):
        converters_json.request_from_json("m", "", body, binary=x.tobytes() + raw_words + b"1234")
    response = InferResponse("m", "1", "", (Tensor("y", "FP32", (3, 4), x),))
    payload, split = converters_json.response_to_binary(response)
    header = json.loads(payload[:split])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes and "data" not in header["outputs"][0]
    np.testing.assert_array_equal(np.frombuffer(payload[split:], dtype=np.float32).reshape(3, 4), x)
