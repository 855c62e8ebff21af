"""serving/grpc_api/fast_infer.py: the fast decode accepts exactly the common request form, gives the same arrays
as the general path (converters + the data plane's validation), never accepts what the general path
refuses (hypothesis), and its raw answer reads back like the general converter's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.batching import signature
from serving.dataplane import validate_inputs
from serving.errors import InvalidInput
from serving.grpc_api import converters
from serving.grpc_api.fast_infer import InputPlan, raw_response
from serving.proto import grpc_service_pb2 as pb
from serving.types import DATATYPES

INPUTS: dict[str, tuple[str, tuple[int, ...]]] = {"image": ("FP32", (-1, 3, 4)), "mask": ("INT64", (-1, -1))}
OUTPUTS = {"logits": "FP32", "boxes": "INT32"}
MAX_BATCH = 4


def plan() -> InputPlan:
    return InputPlan(INPUTS, OUTPUTS, MAX_BATCH)


def good(rows: int = 2, width: int = 5) -> tuple[pb.ModelInferRequest, dict[str, np.ndarray]]:
    rng = np.random.default_rng(rows * 10 + width)
    arrays = {
        "image": rng.normal(size=(rows, 3, 4)).astype(np.float32),
        "mask": rng.integers(-9, 9, size=(rows, width)).astype(np.int64),
    }
    msg = pb.ModelInferRequest(model_name="m", id="r1")
    for name, array in arrays.items():
        msg.inputs.add(name=name, datatype=INPUTS[name][0], shape=array.shape)
        msg.raw_input_contents.append(array.tobytes())
    return msg, arrays


def general(msg: pb.ModelInferRequest, max_elements: int = 10_000) -> dict[str, np.ndarray]:
    request = converters.request_from_proto(msg, max_elements=max_elements)
    return validate_inputs("m", INPUTS, MAX_BATCH, request.inputs)


def test_the_common_form_decodes_like_the_general_path() -> None:
    msg, arrays = good()
    decoded = plan().decode(msg, 10_000)
    assert decoded is not None
    got, rows, sig = decoded
    assert rows == 2 and sig == signature(got)
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
        np.testing.assert_array_equal(got[name], general(msg)[name])
        assert got[name].dtype == DATATYPES[INPUTS[name][0]]


def test_fixed_shapes_precompute_the_batch_signature() -> None:
    fixed = InputPlan({"x": ("FP32", (-1, 2))}, {"y": "FP32"}, 8)
    msg = pb.ModelInferRequest(model_name="m")
    msg.inputs.add(name="x", datatype="FP32", shape=[3, 2])
    msg.raw_input_contents.append(np.ones((3, 2), np.float32).tobytes())
    decoded = fixed.decode(msg, 100)
    assert decoded is not None and fixed.signature is not None
    assert decoded[2] is fixed.signature and fixed.signature == signature(decoded[0])
    assert plan().signature is None  # "mask" has a free dimension: computed per request


def _variant(kind: str) -> pb.ModelInferRequest:
    msg, _ = good()
    if kind == "typed contents":
        msg.ClearField("raw_input_contents")
        msg.inputs[0].contents.fp32_contents.extend([0.0] * 24)
        msg.inputs[1].contents.int64_contents.extend([0] * 10)
    elif kind == "other order":
        reordered = pb.ModelInferRequest(model_name="m")
        for index in (1, 0):
            reordered.inputs.add().CopyFrom(msg.inputs[index])
            reordered.raw_input_contents.append(msg.raw_input_contents[index])
        msg = reordered
    elif kind == "request parameter":
        msg.parameters["binary_data_output"].bool_param = False
    elif kind == "input parameter":
        msg.inputs[0].parameters["k"].int64_param = 1
    elif kind == "output parameter":
        msg.outputs.add(name="logits").parameters["classification"].int64_param = 2
    elif kind == "unknown output":
        msg.outputs.add(name="nope")
    elif kind == "wrong datatype":
        msg.inputs[0].datatype = "FP64"
    elif kind == "wrong shape":
        msg.inputs[0].shape[2] = 5
    elif kind == "short buffer":
        msg.raw_input_contents[0] = msg.raw_input_contents[0][:-4]
    elif kind == "batch over the cap":
        msg, _ = good(rows=MAX_BATCH + 1)
    elif kind == "missing input":
        del msg.inputs[1]
        del msg.raw_input_contents[1]
    elif kind == "rows disagree":
        msg.inputs[1].shape[0] = 1
        msg.raw_input_contents[1] = msg.raw_input_contents[1][: len(msg.raw_input_contents[1]) // 2]
    elif kind == "negative free dimension":
        msg.inputs[1].shape[1] = -5
    return msg


@pytest.mark.parametrize(
    "kind",
    [
        "typed contents",
        "other order",
        "request parameter",
        "input parameter",
        "output parameter",
        "unknown output",
        "wrong datatype",
        "wrong shape",
        "short buffer",
        "batch over the cap",
        "missing input",
        "rows disagree",
        "negative free dimension",
    ],
)
def test_anything_else_goes_to_the_general_path(kind: str) -> None:
    assert plan().decode(_variant(kind), 10_000) is None


def test_the_element_cap_holds_on_the_fast_path() -> None:
    msg, _ = good()
    assert plan().decode(msg, 34) is not None  # 24 + 10 elements
    assert plan().decode(msg, 33) is None
    with pytest.raises(InvalidInput, match="expected at most 33"):
        general(msg, max_elements=33)


def test_bytes_inputs_always_take_the_general_path() -> None:
    assert not InputPlan({"text": ("BYTES", (-1,))}, {"y": "FP32"}, 4).enabled


@st.composite
def near_misses(draw: st.DrawFn) -> pb.ModelInferRequest:
    """Mostly the common form, with random damage to names, datatypes, shapes, buffers and extras."""
    rows = draw(st.integers(0, MAX_BATCH + 1)) if draw(st.integers(0, 5)) == 0 else draw(st.integers(1, MAX_BATCH))
    width = draw(st.integers(0, 3))
    msg = pb.ModelInferRequest(model_name="m")
    names = draw(st.permutations(["image", "mask"])) if draw(st.integers(0, 9)) == 0 else ["image", "mask"]
    for name in names[: draw(st.integers(1, 2)) if draw(st.integers(0, 9)) == 0 else 2]:
        datatype, shape = INPUTS[name]
        dims = [rows, *(width if d < 0 else d for d in shape[1:])]
        if draw(st.integers(0, 9)) == 0:
            dims[draw(st.integers(0, len(dims) - 1))] = draw(st.integers(-2, 6))
        if draw(st.integers(0, 8)) == 0:
            dims.append(1)
        datatype = draw(st.sampled_from(list(DATATYPES))) if draw(st.integers(0, 9)) == 0 else datatype
        item = msg.inputs.add(name=name if draw(st.integers(0, 8)) else "other", datatype=datatype, shape=dims)
        size = max(0, int(np.prod(dims))) * (DATATYPES[datatype].itemsize if datatype != "BYTES" else 4)
        size += draw(st.sampled_from([-1, 1, 4])) if draw(st.integers(0, 9)) == 0 else 0
        msg.raw_input_contents.append(draw(st.binary(min_size=max(size, 0), max_size=max(size, 0))))
        if draw(st.integers(0, 9)) == 0:
            item.parameters["p"].bool_param = True
        if draw(st.integers(0, 9)) == 0:
            item.contents.fp32_contents.append(1.0)
    if draw(st.integers(0, 9)) == 0:
        msg.raw_input_contents.append(b"")
    outputs = ["logits", "boxes", "nope"] if draw(st.integers(0, 9)) == 0 else ["logits", "boxes"]
    for name in draw(st.lists(st.sampled_from(outputs), max_size=2, unique=True)):
        msg.outputs.add(name=name)
    return msg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_misses())
def test_fuzz_the_fast_path_accepts_only_what_the_general_path_accepts(msg: pb.ModelInferRequest) -> None:
    decoded = plan().decode(msg, 10_000)
    if decoded is None:
        return  # the general path decides, with its own errors
    arrays, rows, sig = decoded
    expected = general(msg)  # raises if the fast path accepted something the general path refuses
    assert set(arrays) == set(expected) and sig == signature(arrays)
    for name, array in expected.items():
        assert arrays[name].shape == array.shape and arrays[name].shape[0] == rows
        np.testing.assert_array_equal(arrays[name].view(np.uint8), np.ascontiguousarray(array).view(np.uint8))


def test_raw_response_reads_back_like_the_general_one() -> None:
    outputs: dict[str, Any] = {
        "logits": np.arange(8, dtype=np.float32).reshape(2, 4),
        "boxes": np.array([[1, 2], [3, 4]], dtype=np.int64),  # widened by a runtime: sent as INT32
    }
    answer = raw_response("m", "3", "r1", ["boxes", "logits"], OUTPUTS, outputs, {"abnormal": True})
    assert (answer.model_name, answer.model_version, answer.id) == ("m", "3", "r1")
    assert answer.parameters["abnormal"].bool_param is True
    assert [o.name for o in answer.outputs] == ["boxes", "logits"]
    assert [o.datatype for o in answer.outputs] == ["INT32", "FP32"]
    boxes = np.frombuffer(answer.raw_output_contents[0], dtype="<i4").reshape(tuple(answer.outputs[0].shape))
    logits = np.frombuffer(answer.raw_output_contents[1], dtype="<f4").reshape(tuple(answer.outputs[1].shape))
    np.testing.assert_array_equal(boxes, outputs["boxes"])
    np.testing.assert_array_equal(logits, outputs["logits"])
    assert plan().wanted_outputs(pb.ModelInferRequest()) == ["logits", "boxes"]
