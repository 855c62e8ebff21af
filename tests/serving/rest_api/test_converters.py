"""serving/rest_api/converters.py with serving/codec.py: every V2 datatype in JSON both ways, outputs and
parameters, each refusal named, the element cap, and Triton's binary tensor data extension."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from serving.errors import InvalidInput
from serving.rest_api import converters
from serving.types import (
    InferResponse,
    Tensor,
)
from tests.serving.wire import ARRAYS, assert_same

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
    request = converters.request_from_json("pcb", "2", body)
    expected = (
        np.array([[v.encode() for v in row] for row in array.tolist()], dtype=object) if datatype == "BYTES" else array
    )
    assert_same(request.inputs[0], datatype, expected)
    assert (request.model_name, request.model_version, request.id, request.raw_output) == ("pcb", "2", "j1", False)

    answer = converters.response_to_json(InferResponse("pcb", "2", "j1", request.inputs, {"n": np.int64(3)}))
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
    request = converters.request_from_json("pcb", "", body)
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
        converters.request_from_json("pcb", "", body)


def test_json_element_cap() -> None:
    with pytest.raises(
        InvalidInput,
        match=r"input 'x': shape \[2, 2\] has 4 elements, which brings the request to 4; expected at most 3",
    ):
        converters.request_from_json("pcb", "", _json_input(), max_elements=3)


def test_a_bytes_output_json_cannot_carry_is_refused_by_name() -> None:
    output = Tensor("blob", "BYTES", (2,), np.array([b"ok", b"\xff\xfe"], dtype=object))
    with pytest.raises(
        InvalidInput, match="output 'blob': element 1 is not UTF-8 text, which JSON cannot carry; request it over gRPC"
    ):
        converters.response_to_json(InferResponse("m", "1", "", (output,)))


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
    request = converters.request_from_json("m", "", body, binary=x.tobytes() + raw_words)
    np.testing.assert_array_equal(request.inputs[0].data, x)
    assert list(request.inputs[1].data) == [b"ab", b""] and request.raw_output
    assert "binary_data_size" not in request.inputs[0].parameters
    with pytest.raises(InvalidInput, match="4 binary bytes after the JSON header belong to no input"):
        converters.request_from_json("m", "", body, binary=x.tobytes() + raw_words + b"1234")
    response = InferResponse("m", "1", "", (Tensor("y", "FP32", (3, 4), x),))
    payload, split = converters.response_to_binary(response)
    header = json.loads(payload[:split])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes and "data" not in header["outputs"][0]
    np.testing.assert_array_equal(np.frombuffer(payload[split:], dtype=np.float32).reshape(3, 4), x)
