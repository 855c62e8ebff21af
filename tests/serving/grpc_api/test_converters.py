"""serving/grpc_api/converters.py with serving/codec.py: every V2 datatype both ways, typed and raw;
parameters and requested outputs; each refusal names the input and what was expected."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
import pytest

from serving.errors import InvalidInput
from serving.grpc_api import converters
from serving.proto import grpc_service_pb2 as pb
from serving.types import (
    DATATYPES,
    InferResponse,
    Tensor,
)
from tests.serving.wire import ARRAYS, TYPED, as_request, assert_same, infer_request, raw_bytes

# --- round trips, every datatype -----------------------------------------------------------------


@pytest.mark.parametrize("datatype", TYPED)
def test_typed_request_every_datatype(datatype: str) -> None:
    request = converters.request_from_proto(infer_request({"x": (datatype, ARRAYS[datatype])}, raw=False))
    (tensor,) = request.inputs
    assert_same(tensor, datatype, ARRAYS[datatype])
    assert (request.model_name, request.model_version, request.id, request.raw_output) == ("pcb", "1", "req-7", False)


@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_raw_request_every_datatype(datatype: str) -> None:
    request = converters.request_from_proto(infer_request({"x": (datatype, ARRAYS[datatype])}, raw=True))
    assert_same(request.inputs[0], datatype, ARRAYS[datatype])
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
        assert msg.raw_output_contents[0] == raw_bytes(datatype, array)
    (tensor,) = converters.request_from_proto(as_request(msg)).inputs
    assert_same(tensor, datatype, array)


def test_one_fp16_output_makes_the_whole_response_raw() -> None:
    outputs = (Tensor("a", "FP32", (1,), np.ones(1, np.float32)), Tensor("b", "FP16", (1,), np.ones(1, np.float16)))
    msg = converters.response_to_proto(InferResponse("m", "1", "", outputs), raw=False)
    assert len(msg.raw_output_contents) == 2
    assert not msg.outputs[0].contents.ListFields()


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
@pytest.mark.parametrize("datatype", ["FP32", "BYTES", "BOOL"])
def test_empty_tensors(datatype: str, raw: bool) -> None:
    array = np.empty((0, 3), dtype=DATATYPES[datatype])
    (tensor,) = converters.request_from_proto(infer_request({"x": (datatype, array)}, raw=raw)).inputs
    assert_same(tensor, datatype, array)


def test_many_inputs_keep_their_order_and_buffers() -> None:
    tensors = {f"in{i}": (dt, ARRAYS[dt]) for i, dt in enumerate(ARRAYS)}
    request = converters.request_from_proto(infer_request(tensors, raw=True))
    for tensor, (name, (datatype, array)) in zip(request.inputs, tensors.items(), strict=True):
        assert tensor.name == name
        assert_same(tensor, datatype, array)


def test_raw_bool_reads_any_nonzero_byte_as_true() -> None:
    msg = pb.ModelInferRequest(raw_input_contents=[b"\x00\x01\x02\xff"])
    msg.inputs.add(name="mask", datatype="BOOL", shape=[4])
    assert converters.request_from_proto(msg).inputs[0].data.tolist() == [False, True, True, True]


# --- parameters, requested outputs, raw_output -----------------------------------------------------


def _set(params: MutableMapping[str, pb.InferParameter], **values: tuple[str, Any]) -> None:
    for key, (field, value) in values.items():
        setattr(params[key], field, value)


def test_parameters_of_every_kind_at_every_level() -> None:
    msg = infer_request({"x": ("FP32", ARRAYS["FP32"])}, raw=True)
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
    msg = infer_request({"x": ("FP32", ARRAYS["FP32"])}, raw=raw)
    if binary_data_output is not None:
        msg.parameters["binary_data_output"].bool_param = binary_data_output
    assert converters.request_from_proto(msg).raw_output is expected


# --- every refusal names the input and the expected value --------------------------------------------

Mutation = Callable[[pb.ModelInferRequest], None]


def _base() -> pb.ModelInferRequest:
    """``image`` FP32 [2, 3] and ``mask`` BOOL [2], raw."""
    return infer_request({"image": ("FP32", ARRAYS["FP32"]), "mask": ("BOOL", np.array([True, False]))}, raw=True)


def _typed_base() -> pb.ModelInferRequest:
    return infer_request({"image": ("FP32", ARRAYS["FP32"]), "mask": ("BOOL", np.array([True, False]))}, raw=False)


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
        _bytes_input(struct.pack("<I", 5) + b"abcde" + b"\x02\x00"),
        "input 'text': raw BYTES contents end after 1 of 2 elements",
    ),
    "BYTES count the buffer cannot hold": (
        _bytes_input(struct.pack("<I", 1) + b"a" + b"\x02\x00"),
        r"input 'text': raw BYTES contents are 7 bytes, too few for the 2 elements of shape \[2\]",
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


def test_messages_name_the_input_not_the_whole_request() -> None:
    # A status message travels in a gRPC trailer: long names are cut, and only a few are listed.
    msg = pb.ModelInferRequest(raw_input_contents=[b""])
    for i in range(20):
        msg.inputs.add(name=f"input_{i}_" + "x" * 200, datatype="FP32", shape=[0])
    with pytest.raises(InvalidInput) as caught:
        converters.request_from_proto(msg)
    assert len(str(caught.value)) < 1000 and re.search(r"'input_0_x+', .*, \.\.\.\]", str(caught.value))
