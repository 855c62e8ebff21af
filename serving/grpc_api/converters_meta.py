"""Server and model metadata, the repository index, Triton's ModelConfig (from our ``config.json``) and
ModelStatistics as KServe V2 / Triton gRPC messages, which Triton's clients and perf_analyzer read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from serving.errors import RepositoryError
from serving.proto import grpc_service_pb2 as pb
from serving.types import DATATYPES, ModelMetadata, RepositoryEntry

# Our platform names -> Triton's (platform, backend), which its clients and perf_analyzer expect.
_TRITON_PLATFORMS = {"onnxruntime": ("onnxruntime_onnx", "onnxruntime"), "tensorrt": ("tensorrt_plan", "tensorrt")}


def _triton_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


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
