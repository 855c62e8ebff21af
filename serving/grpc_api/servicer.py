"""The gRPC servicers: KServe V2 ``inference.GRPCInferenceService`` (with Triton's ModelConfig and
ModelStatistics extensions, so Triton's clients and perf_analyzer work) and the traffic admin service.
Each method converts (serving/grpc_api/converters.py, converters_meta.py), calls the data plane, converts
back; errors are mapped by serving/grpc_api/rpc_errors.py. ModelInfer takes the fast path of
serving/grpc_api/fast_infer.py for requests of the common form."""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from typing import Any

import grpc

from serving.batching import BatcherStats
from serving.dataplane import DataPlane
from serving.errors import ModelNotReady, ServingError, Unauthenticated
from serving.grpc_api import converters, converters_meta, fast_infer
from serving.observability.metrics import ServerMetrics
from serving.observability.tracing import current_trace_id
from serving.proto import admin_pb2, admin_pb2_grpc, grpc_service_pb2, grpc_service_pb2_grpc

pb = grpc_service_pb2
INFERENCE_METHODS = [
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "ModelInfer",
]
ADMIN_METHODS = ["SetTrafficWeights", "GetTrafficWeights"]


class InferenceServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        dataplane: DataPlane,
        metrics: ServerMetrics,
        *,
        name: str,
        version: str,
        max_elements: int,
        request_log: Any = None,
    ):
        self.plane, self.metrics = dataplane, metrics
        telemetry = dataplane.telemetry
        self.tracing: Any = telemetry.tracing if telemetry is not None else None
        self.pipeline: Any = telemetry.pipeline if telemetry is not None else None
        # The request log runs on the telemetry thread: without telemetry there is none.
        self.request_log: Any = request_log if self.pipeline is not None else None
        self.name, self.version, self.max_elements = name, version, max_elements

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=self.plane.live())

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.plane.ready())

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version))

    def ServerMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return converters_meta.server_metadata_to_proto(self.name, self.version, ["model_repository", "statistics"])

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return converters_meta.model_metadata_to_proto(self.plane.metadata(request.name, request.version))

    def ModelConfig(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ModelConfigResponse(
            config=converters_meta.model_config_to_proto(self.plane.config(request.name, request.version))
        )

    def ModelStatistics(self, request: Any, context: grpc.ServicerContext) -> Any:
        return converters_meta.model_statistics_to_proto(
            _version_stats(name, version, stats)
            for name, version, stats in self.plane.stats(request.name, request.version)
        )

    def RepositoryIndex(self, request: Any, context: grpc.ServicerContext) -> Any:
        entries = [e for e in self.plane.index() if not request.ready or e.state == "READY"]
        return converters_meta.repository_index_to_proto(entries)

    def RepositoryModelLoad(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.plane.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.plane.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        model, version = request.model_name, request.model_version
        request_id = request.id or secrets.token_hex(16)  # an empty id must not share one sampling decision
        served = _Served()
        tracing = self.tracing
        with contextlib.ExitStack() as stack:
            if tracing is not None:
                metadata = context.invocation_metadata()
                stack.enter_context(tracing.request(metadata, model=model, version=version, request_id=request_id))
            try:
                return self._infer(request, served, tracing)
            except ServingError as exc:
                served.code = exc.code.name
                raise
            except Exception:
                served.code = "INTERNAL"
                raise
            finally:
                elapsed = time.perf_counter() - start
                self.metrics.observe(model, served.version or version, served.code, elapsed)
                log = self.request_log
                if log is not None and log.wanted(request_id, served.code):
                    self._log(request, context, request_id, served, elapsed)

    def _infer(self, request: Any, served: _Served, tracing: Any) -> Any:
        model, version = request.model_name, request.model_version
        for attempt in (0, 1):
            loaded = self.plane.route(model, version)
            served.version = loaded.version  # an error from here on counts against the version that failed
            plan = loaded.plan or self._plan(loaded)
            decoded = plan.decode(request, self.max_elements)
            if decoded is None:  # anything but the common form: the general path and its named errors
                return self._general(request, served, tracing)
            inputs, served.rows, sig = decoded
            try:
                outputs = self.plane.run(loaded, inputs, served.rows, sig)
                break
            except ModelNotReady:
                # Routed to a version being unloaded between choosing and queueing: choose again, once,
                # unless the client asked for that very version.
                if attempt or version:
                    raise
        runtime = str(loaded.runtime.level_name)
        served.version, served.runtime, served.monitors = loaded.version, runtime, loaded.monitors
        if loaded.outputs:
            served.logits = outputs.get(next(iter(loaded.outputs)))
        with tracing.postprocess() if tracing is not None else contextlib.nullcontext():
            return fast_infer.raw_response(
                model,
                loaded.version,
                request.id,
                plan.wanted_outputs(request),
                plan.outputs,
                outputs,
                {"abnormal": True} if runtime == "rules" else None,  # not the model's answer: do not trust it
            )

    def _plan(self, loaded: Any) -> fast_infer.InputPlan:
        loaded.plan = fast_infer.InputPlan(loaded.inputs, loaded.outputs, loaded.max_batch_size)
        return loaded.plan  # type: ignore[no-any-return]

    def _general(self, request: Any, served: _Served, tracing: Any) -> Any:
        """Typed contents, BYTES, parameters, another input order, or a mistake (refused here, named)."""
        parsed = converters.request_from_proto(request, max_elements=self.max_elements)
        served.rows = _rows(request)
        response = self.plane.infer(parsed)
        served.version, served.runtime = response.model_version, response.served.get("runtime")
        served.logits, served.monitors = response.served.get("logits"), response.served.get("monitors")
        with tracing.postprocess() if tracing is not None else contextlib.nullcontext():
            return converters.response_to_proto(response, raw=parsed.raw_output)

    def _log(
        self, request: Any, context: grpc.ServicerContext, request_id: str, served: _Served, elapsed: float
    ) -> None:
        """Queue the request's log line; the trace id, the input hash and the JSON are made on the
        telemetry thread, so the request thread only takes a snapshot."""
        trace = current_trace_id() if self.tracing is not None else None
        metadata = None if self.tracing is not None else context.invocation_metadata()
        size = sum(len(buffer) for buffer in request.raw_input_contents) or request.ByteSize()
        line = (request_id, served.version, served.runtime, served.rows, elapsed, served.code, trace, metadata)
        self.pipeline.submit("log", self._write_log, request, line, served.logits, served.monitors, size=size)

    def _write_log(self, request: Any, line: tuple[Any, ...], logits: Any, monitors: Any) -> None:
        from serving.observability.logs import input_hash
        from serving.observability.monitors import min_confidence
        from serving.observability.tracing import incoming_trace_id

        request_id, version, runtime, rows, elapsed, code, trace, metadata = line
        raw = request.raw_input_contents
        runtime = runtime if code == "OK" else None
        self.request_log.log(
            request_id=request_id,
            model_name=request.model_name,
            model_version=version or request.model_version,
            input_hash=input_hash(raw) if raw else _typed_hash(request),
            runtime=runtime,
            batch_size=rows or _rows(request),
            inference_time_ms=elapsed * 1e3,
            output_confidence=min_confidence(logits),
            abnormal_flag=runtime == "rules" or bool(monitors is not None and monitors.abnormal),
            gpu_utilization=self.metrics.gpu.utilization() if hasattr(self.metrics, "gpu") else None,
            status=code,
            trace_id=trace if metadata is None else incoming_trace_id(metadata),
        )


class _Served:
    """What one ModelInfer call learned on the way, for its metrics and its log line."""

    __slots__ = ("code", "logits", "monitors", "rows", "runtime", "version")

    def __init__(self) -> None:
        self.code = "OK"
        self.rows = 0
        self.version = ""
        self.runtime: str | None = None
        self.logits: Any = None
        self.monitors: Any = None


def _rows(request: Any) -> int:
    return int(request.inputs[0].shape[0]) if request.inputs and request.inputs[0].shape else 0


def _typed_hash(request: Any) -> str | None:
    """The input hash of a request sent with typed contents: its decoded arrays, hashed as raw bytes."""
    from serving.observability.logs import input_hash

    try:
        parsed = converters.request_from_proto(request)
    except ServingError:
        return None  # a request refused at decoding has no inputs to speak of
    return input_hash(tensor.data for tensor in parsed.inputs)


class AdminServicer(admin_pb2_grpc.TrafficAdminServicer):
    """Traffic weights over gRPC; the caller sends ``authorization: Bearer <token>`` metadata."""

    def __init__(self, dataplane: DataPlane, token: str | None) -> None:
        self.plane, self.token = dataplane, token

    def _authorise(self, context: grpc.ServicerContext) -> None:
        if not self.token:
            raise Unauthenticated("admin calls are disabled: set SLUICEGATE_SERVING__ADMIN_TOKEN on the server")
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(str(given).encode(), f"Bearer {self.token}".encode()):
            raise Unauthenticated("admin call without the right token (metadata authorization: Bearer <token>)")

    def SetTrafficWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorise(context)
        weights = self.plane.set_weights(request.model_name, dict(request.weights))
        return admin_pb2.TrafficWeightsResponse(model_name=request.model_name, weights=weights)

    def GetTrafficWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorise(context)
        weights = self.plane.weights(request.model_name)
        return admin_pb2.TrafficWeightsResponse(model_name=request.model_name, weights=weights)


def _version_stats(name: str, version: str, stats: BatcherStats) -> converters_meta.ModelVersionStats:
    """Triton's statistics from the batcher's counters: an execution is a batch, an inference a row."""
    return converters_meta.ModelVersionStats(
        name=name,
        version=version,
        last_inference_ms=stats.last_inference_ms,
        inference_count=stats.rows,
        execution_count=stats.batches,
        success=converters_meta.DurationStats(
            stats.requests - stats.failures, stats.queue_ns_total + stats.exec_ns_total
        ),
        fail=converters_meta.DurationStats(stats.failures + stats.rejected, 0),
        queue=converters_meta.DurationStats(stats.requests, stats.queue_ns_total),
        compute_infer=converters_meta.DurationStats(stats.batches, stats.exec_ns_total),
    )
