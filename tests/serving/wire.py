"""V2 wire values for the converter tests, written independently of the code under test: a sample
array of every datatype, the typed contents field of each, the raw encoding (BYTES by tritonclient), and
requests built from arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.utils import serialize_byte_tensor

from serving.proto import grpc_service_pb2 as pb
from serving.types import DATATYPES, Tensor

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


def raw_bytes(datatype: str, array: np.ndarray[Any, Any]) -> bytes:
    """The V2 raw encoding, written independently of the code under test (BYTES by tritonclient)."""
    if datatype == "BYTES":
        return bytes(serialize_byte_tensor(array).item()) if array.size else b""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def infer_request(tensors: dict[str, tuple[str, np.ndarray[Any, Any]]], raw: bool) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="pcb", model_version="1", id="req-7")
    for name, (datatype, array) in tensors.items():
        item = msg.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            msg.raw_input_contents.append(raw_bytes(datatype, array))
        else:
            getattr(item.contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
    return msg


def as_request(response: pb.ModelInferResponse) -> pb.ModelInferRequest:
    """A response re-read as a request: InferOutputTensor and InferInputTensor share fields 1-5 on the wire."""
    msg = pb.ModelInferRequest(model_name=response.model_name, id=response.id)
    for out in response.outputs:
        msg.inputs.add().MergeFromString(out.SerializeToString())
    msg.raw_input_contents.extend(response.raw_output_contents)
    return msg


def assert_same(tensor: Tensor, datatype: str, array: np.ndarray[Any, Any]) -> None:
    assert (tensor.datatype, tensor.shape) == (datatype, array.shape)
    assert tensor.data.shape == array.shape
    assert tensor.data.dtype == DATATYPES[datatype]
    if datatype == "BYTES":
        assert tensor.data.tolist() == array.tolist()
    else:
        np.testing.assert_array_equal(tensor.data, array)
