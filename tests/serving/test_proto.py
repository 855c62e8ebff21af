"""serving/proto against Triton's own generated code (tritonclient 2.73): same names and field numbers,
messages that cross between the two unchanged, a real gRPC round trip with tritonclient's client, and
checked-in code that matches the .proto files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from tritonclient.grpc import _utils as triton_utils
from tritonclient.grpc import model_config_pb2 as triton_config_pb2
from tritonclient.grpc import service_pb2 as triton_pb2

from serving.grpc_api import converters, converters_meta
from serving.proto import admin_pb2, grpc_service_pb2, grpc_service_pb2_grpc
from serving.types import DATATYPES, InferResponse, ModelMetadata, Tensor, TensorMetadata

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "serving" / "proto"
pb = grpc_service_pb2

CONFIG: dict[str, Any] = {
    "format": 1,
    "name": "pcb",
    "version": "3",
    "platform": "onnxruntime",
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 2]}],
    "labels": ["good", "defect"],
    "preprocessing": {},
    "batching": {"max_batch_size": 8, "max_queue_delay_us": 100, "max_queue_size": 256},
    "lineage": {"mlflow_run_id": "abc123"},
}


# --- schema: every name and number is Triton's -------------------------------------------------------


def _triton_message(name: str) -> Descriptor:
    for module in (triton_pb2, triton_config_pb2):
        if name in module.DESCRIPTOR.message_types_by_name:
            return module.DESCRIPTOR.message_types_by_name[name]
    raise AssertionError(f"Triton has no message {name}")


def _triton_enum(name: str) -> EnumDescriptor:
    return triton_config_pb2.DESCRIPTOR.enum_types_by_name[name]


def _type_name(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        return field.message_type.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return ""


def _assert_same_message(ours: Descriptor, theirs: Descriptor) -> None:
    assert ours.full_name == theirs.full_name
    for field in ours.fields:
        assert field.name in theirs.fields_by_name, f"{ours.full_name}.{field.name} is not in Triton's message"
        other = theirs.fields_by_name[field.name]
        where = f"{ours.full_name}.{field.name}"
        assert (field.number, field.type, field.is_repeated) == (other.number, other.type, other.is_repeated), where
        assert _type_name(field) == _type_name(other), where
        ours_oneof = field.containing_oneof.name if field.containing_oneof else None
        theirs_oneof = other.containing_oneof.name if other.containing_oneof else None
        assert ours_oneof == theirs_oneof, where
    for nested in ours.nested_types:
        _assert_same_message(nested, theirs.nested_types_by_name[nested.name])
    for enum in ours.enum_types:
        _assert_same_enum(enum, theirs.enum_types_by_name[enum.name])


def _assert_same_enum(ours: EnumDescriptor, theirs: EnumDescriptor) -> None:
    assert ours.full_name == theirs.full_name
    assert {v.name: v.number for v in ours.values} == {v.name: v.number for v in theirs.values}


@pytest.mark.parametrize("name", sorted(pb.DESCRIPTOR.message_types_by_name))
def test_every_message_has_tritons_names_and_numbers(name: str) -> None:
    _assert_same_message(pb.DESCRIPTOR.message_types_by_name[name], _triton_message(name))


def test_enums_and_the_service_are_tritons() -> None:
    for name, enum in pb.DESCRIPTOR.enum_types_by_name.items():
        _assert_same_enum(enum, _triton_enum(name))
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    expected = {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    }
    assert set(ours.methods_by_name) == expected
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name, method.name
        assert method.output_type.full_name == other.output_type.full_name, method.name


def test_admin_service_shape() -> None:
    service = admin_pb2.DESCRIPTOR.services_by_name["TrafficAdmin"]
    assert service.full_name == "sluicegate.admin.TrafficAdmin"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "SetTrafficWeights": ("SetTrafficWeightsRequest", "TrafficWeightsResponse"),
        "GetTrafficWeights": ("GetTrafficWeightsRequest", "TrafficWeightsResponse"),
    }
    message = admin_pb2.SetTrafficWeightsRequest(model_name="pcb", weights={"1": 90, "2": 10})
    answer = admin_pb2.TrafficWeightsResponse.FromString(message.SerializeToString())
    assert answer.model_name == "pcb" and dict(answer.weights) == {"1": 90, "2": 10}


@pytest.mark.parametrize("first", ["serving", "tritonclient"])
def test_our_messages_and_tritonclients_load_in_one_process(first: str) -> None:
    # A fresh interpreter, so the import order is the one under test.
    imports = ["from serving.proto import grpc_service_pb2_grpc", "import tritonclient.grpc"]
    if first == "tritonclient":
        imports.reverse()
    code = "; ".join([*imports, "print('ok')"])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# --- messages cross between tritonclient's code and ours ---------------------------------------------


def _triton_input(name: str, array: np.ndarray[Any, Any], datatype: str) -> triton.InferInput:
    item = triton.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array)
    return item


ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "BOOL": np.array([[True, False], [False, True]]),
    "UINT8": np.array([[0, 255], [7, 8]], dtype=np.uint8),
    "UINT16": np.array([[0, 65535], [7, 8]], dtype=np.uint16),
    "UINT32": np.array([[0, 2**32 - 1], [7, 8]], dtype=np.uint32),
    "UINT64": np.array([[0, 2**64 - 1], [7, 8]], dtype=np.uint64),
    "INT8": np.array([[-128, 127], [0, 1]], dtype=np.int8),
    "INT16": np.array([[-(2**15), 2**15 - 1], [0, 1]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 2**31 - 1], [0, 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1], [0, 1]], dtype=np.int64),
    "FP16": np.array([[0.5, -2.0], [65504.0, 1e-3]], dtype=np.float16),
    "FP32": np.array([[0.5, -2.0], [3.4e38, np.inf]], dtype=np.float32),
    "FP64": np.array([[0.5, -2.0], [1e308, np.nan]], dtype=np.float64),
    "BYTES": np.array([[b"", b"defect"], ["güt".encode(), b"\x00\xff"]], dtype=np.object_),
}


# The V2 spec's typed field per datatype (FP16 has none).
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


def test_a_request_built_by_tritonclient_decodes_with_ours() -> None:
    inputs = [_triton_input(f"in_{dt.lower()}", array, dt) for dt, array in ARRAYS.items()]
    outputs = [triton.InferRequestedOutput("logits", class_count=2)]
    request = triton_utils._get_inference_request(
        model_name="pcb",
        inputs=inputs,
        model_version="2",
        request_id="req-1",
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=3,
        timeout=None,
        parameters={"tag": "canary", "flag": True, "ratio": 0.5, "n": -4},
    )
    parsed = converters.request_from_proto(pb.ModelInferRequest.FromString(request.SerializeToString()))

    assert (parsed.model_name, parsed.model_version, parsed.id, parsed.raw_output) == ("pcb", "2", "req-1", True)
    assert parsed.parameters == {"tag": "canary", "flag": True, "ratio": 0.5, "n": -4, "priority": 3}
    assert [(o.name, o.parameters) for o in parsed.outputs] == [("logits", {"classification": 2})]
    for tensor, (datatype, array) in zip(parsed.inputs, ARRAYS.items(), strict=True):
        assert (tensor.name, tensor.datatype, tensor.shape) == (f"in_{datatype.lower()}", datatype, array.shape)
        assert tensor.data.dtype == DATATYPES[datatype]
        np.testing.assert_array_equal(tensor.data, array)


def test_our_raw_response_decodes_with_tritonclient() -> None:
    outputs = tuple(Tensor(f"out_{dt.lower()}", dt, array.shape, array) for dt, array in ARRAYS.items())
    response = InferResponse("pcb", "2", "req-1", outputs, parameters={"sequence_end": True})
    wire = converters.response_to_proto(response, raw=True).SerializeToString()
    result = triton.InferResult(triton_pb2.ModelInferResponse.FromString(wire))

    answer = result.get_response()
    assert (answer.model_name, answer.model_version, answer.id) == ("pcb", "2", "req-1")
    assert answer.parameters["sequence_end"].bool_param is True
    assert len(answer.raw_output_contents) == len(ARRAYS)
    for datatype, array in ARRAYS.items():
        decoded = result.as_numpy(f"out_{datatype.lower()}")
        assert decoded.shape == array.shape
        if datatype == "BYTES":
            assert decoded.tolist() == array.tolist()
        else:
            assert decoded.dtype == array.dtype
            np.testing.assert_array_equal(decoded, array)


def test_our_typed_response_reads_as_tritons_message() -> None:
    # Not through InferResult.as_numpy: tritonclient 2.73 reads typed contents for BYTES only, and that
    # path fails under numpy 2 (np.array(..., copy=False)). Its clients always send raw, so get raw back.
    kept = {dt: a for dt, a in ARRAYS.items() if dt != "FP16"}
    outputs = tuple(Tensor(f"out_{dt.lower()}", dt, array.shape, array) for dt, array in kept.items())
    wire = converters.response_to_proto(InferResponse("pcb", "2", "", outputs), raw=False).SerializeToString()
    answer = triton_pb2.ModelInferResponse.FromString(wire)

    assert len(answer.raw_output_contents) == 0
    for out, (datatype, array) in zip(answer.outputs, kept.items(), strict=True):
        assert (out.datatype, list(out.shape)) == (datatype, list(array.shape))
        ((field, values),) = out.contents.ListFields()
        assert field.name == CONTENTS_FIELD[datatype]
        expected = array.reshape(-1).tolist()
        if datatype == "FP64":
            np.testing.assert_array_equal(np.array(values), np.array(expected))
        else:
            assert list(values) == expected, datatype


def test_model_config_reads_as_tritons_and_as_perf_analyzer_sees_it() -> None:
    wire = pb.ModelConfigResponse(config=converters_meta.model_config_to_proto(CONFIG)).SerializeToString()
    theirs = triton_pb2.ModelConfigResponse.FromString(wire).config
    # perf_analyzer turns the ModelConfig into JSON and reads that.
    seen = json_format.MessageToDict(theirs, preserving_proto_field_name=True)

    assert seen["name"] == "pcb" and seen["platform"] == "onnxruntime_onnx" and seen["backend"] == "onnxruntime"
    assert seen["max_batch_size"] == 8
    assert seen["input"] == [{"name": "image", "data_type": "TYPE_FP32", "dims": ["3", "224", "224"]}]
    assert seen["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": ["2"]}]
    assert seen["dynamic_batching"] == {
        "max_queue_delay_microseconds": "100",
        "default_queue_policy": {"max_queue_size": 256},
    }
    assert seen["version_policy"] == {"specific": {"versions": ["3"]}}
    assert seen["parameters"] == {"lineage.mlflow_run_id": {"string_value": "abc123"}}
    assert "sequence_batching" not in seen and "ensemble_scheduling" not in seen


def test_a_triton_model_config_decodes_with_ours_keeping_the_shared_fields() -> None:
    theirs = triton_config_pb2.ModelConfig(
        name="pcb",
        platform="tensorrt_plan",
        max_batch_size=4,
        input=[triton_config_pb2.ModelInput(name="image", data_type=triton_config_pb2.TYPE_FP16, dims=[3, 8, 8])],
        instance_group=[triton_config_pb2.ModelInstanceGroup(kind=triton_config_pb2.ModelInstanceGroup.KIND_GPU)],
        optimization=triton_config_pb2.ModelOptimizationPolicy(priority=1),  # a field we do not keep
    )
    theirs.dynamic_batching.max_queue_delay_microseconds = 50
    ours = pb.ModelConfigResponse.FromString(triton_pb2.ModelConfigResponse(config=theirs).SerializeToString()).config

    assert (ours.name, ours.platform, ours.max_batch_size) == ("pcb", "tensorrt_plan", 4)
    assert ours.input[0].data_type == pb.TYPE_FP16 and list(ours.input[0].dims) == [3, 8, 8]
    assert ours.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU
    assert ours.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert ours.dynamic_batching.max_queue_delay_microseconds == 50


def test_model_statistics_read_as_tritons() -> None:
    stats = converters_meta.ModelVersionStats(
        name="pcb",
        version="2",
        last_inference_ms=1_700_000_000_123,
        inference_count=40,
        execution_count=10,
        success=converters_meta.DurationStats(20, 9_000),
        fail=converters_meta.DurationStats(1, 500),
        queue=converters_meta.DurationStats(21, 3_000),
        compute_infer=converters_meta.DurationStats(20, 5_000),
        batches=(converters_meta.BatchStats(4, compute_infer=converters_meta.DurationStats(10, 5_000)),),
    )
    wire = converters_meta.model_statistics_to_proto([stats]).SerializeToString()
    (theirs,) = triton_pb2.ModelStatisticsResponse.FromString(wire).model_stats

    assert (theirs.name, theirs.version, theirs.last_inference) == ("pcb", "2", 1_700_000_000_123)
    assert (theirs.inference_count, theirs.execution_count) == (40, 10)
    infer = theirs.inference_stats
    assert (infer.success.count, infer.success.ns, infer.fail.count, infer.fail.ns) == (20, 9_000, 1, 500)
    assert (infer.queue.count, infer.queue.ns, infer.compute_infer.count, infer.compute_infer.ns) == (
        21,
        3_000,
        20,
        5_000,
    )
    assert (infer.compute_input.count, infer.cache_hit.count) == (0, 0)
    (batch,) = theirs.batch_stats
    assert (batch.batch_size, batch.compute_infer.count, batch.compute_infer.ns) == (4, 10, 5_000)


# --- over a socket: tritonclient's client against our generated service -----------------------------


class _EchoService(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """Answers ModelInfer with its inputs renamed ``echo_<name>``; enough to cross the wire both ways."""

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        tensor = TensorMetadata("image", "FP32", (-1, 3, 224, 224))
        return converters_meta.model_metadata_to_proto(ModelMetadata("pcb", ("3",), "onnxruntime_onnx", (tensor,), ()))

    def ModelConfig(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ModelConfigResponse(config=converters_meta.model_config_to_proto(CONFIG))

    def ModelStatistics(self, request: Any, context: grpc.ServicerContext) -> Any:
        return converters_meta.model_statistics_to_proto(
            [converters_meta.ModelVersionStats("pcb", "3", inference_count=7)]
        )

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        parsed = converters.request_from_proto(request)
        outputs = tuple(Tensor(f"echo_{t.name}", t.datatype, t.shape, t.data) for t in parsed.inputs)
        response = InferResponse(parsed.model_name, parsed.model_version or "3", parsed.id, outputs)
        return converters.response_to_proto(response, raw=parsed.raw_output)


@pytest.fixture
def echo_url() -> Iterator[str]:
    # so_reuseport 0: with grpc's default a stale server can silently share the port (FACTS.md).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_EchoService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_tritonclient_talks_to_our_generated_service(echo_url: str) -> None:
    client = triton.InferenceServerClient(echo_url)
    try:
        assert client.is_server_live()
        assert client.get_model_metadata("pcb").inputs[0].shape == [-1, 3, 224, 224]
        assert client.get_model_config("pcb", as_json=True)["config"]["max_batch_size"] == 8
        assert client.get_inference_statistics("pcb").model_stats[0].inference_count == 7
        inputs = [_triton_input(f"in_{dt.lower()}", array, dt) for dt, array in ARRAYS.items()]
        result = client.infer("pcb", inputs, request_id="r-9")
    finally:
        client.close()
    assert result.get_response().id == "r-9"
    for datatype, array in ARRAYS.items():
        decoded = result.as_numpy(f"echo_in_{datatype.lower()}")
        if datatype == "BYTES":
            assert decoded.tolist() == array.tolist()
        else:
            np.testing.assert_array_equal(decoded, array)


# --- the checked-in code is what the .proto files generate --------------------------------------------


def _generated(root: Path) -> dict[str, bytes]:
    folder = root / "serving" / "proto"
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if "_pb2" in p.name and p.is_file()}


def test_checked_in_code_matches_the_proto_files(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    script = ROOT / "scripts" / "generate_proto.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh, checked_in = _generated(tmp_path), _generated(ROOT)
    assert sorted(fresh) == sorted(checked_in), "generated files differ: run `make generate`"
    for name, content in fresh.items():
        assert content == checked_in[name], f"serving/proto/{name} drifted from its .proto: run `make generate`"
