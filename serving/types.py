"""Protocol-agnostic request and response types of the data plane (KServe V2 / Open Inference Protocol).

The gRPC servicer and the HTTP side port convert to and from these (serving/grpc_api/converters.py and
serving/rest_api/converters.py); the data plane, batching and runtimes see only these. Tensor data is always
a numpy array here, whatever way the client sent it (typed ``contents`` or ``raw_input_contents``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# V2 datatype name -> numpy dtype. BYTES is a variable-length string tensor (object array of bytes).
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
# Little-endian on the wire for raw contents (the V2 spec); numpy dtypes above are native (little-endian
# on every platform we run on: x86-64, aarch64).


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # a key of DATATYPES
    shape: tuple[int, ...]
    data: npt.NDArray[Any]  # shape == self.shape, dtype == DATATYPES[datatype]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    model_version: str  # "" = routed by traffic weights
    id: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[RequestedOutput, ...] = ()  # empty = every output
    parameters: dict[str, Any] = field(default_factory=dict)
    raw_output: bool = True  # answer in raw_output_contents (what the request style implies)


@dataclass(frozen=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: tuple[Tensor, ...]
    parameters: dict[str, Any] = field(default_factory=dict)
    # Not sent to the client: what the request log records (runtime, output_confidence).
    served: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for variable dimensions (the batch axis)


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str  # "onnxruntime_onnx", "tensorrt_plan" (Triton's names)
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    version: str
    state: str  # "READY", "LOADING", "UNAVAILABLE", "UNLOADING"
    reason: str = ""
