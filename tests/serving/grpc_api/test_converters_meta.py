"""serving/grpc_api/converters_meta.py: server and model metadata, the repository index, Triton's ModelConfig
from config.json (refusing what Triton could not describe) and ModelStatistics."""

from __future__ import annotations

from typing import Any

import pytest

from serving.errors import RepositoryError
from serving.grpc_api import converters_meta
from serving.proto import grpc_service_pb2 as pb
from serving.types import (
    DATATYPES,
    ModelMetadata,
    RepositoryEntry,
    TensorMetadata,
)


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
