"""The gRPC servicers: KServe V2 ``inference.GRPCInferenceService`` (with Triton's ModelConfig and
ModelStatistics extensions, so Triton's clients and perf_analyzer work) and the traffic admin service.
Each method converts, calls the data plane, converts back; errors are mapped by the interceptor."""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from typing import Any

import grpc

from serving import converters, converters_meta
from serving.batching import BatcherStats
from serving.dataplane import DataPlane
from serving.errors import ServingError, Unauthenticated
from serving.metrics import ServerMetrics
from serving.proto import admin_pb2, admin_pb2_grpc, grpc_service_pb2, grpc_service_pb2_grpc

pb = grpc_service_pb2


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
        self.plane, self.metrics, self.request_log = dataplane, metrics, request_log
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
        request_id = request.id or uuid.uuid4().hex  # an empty id must not share one sampling decision
        version, code, rows, served = request.model_version, "OK", 0, {}
        tracing = self.plane.telemetry.tracing if self.plane.telemetry is not None else None
        with contextlib.ExitStack() as stack:
            if tracing is not None:
                stack.enter_context(
                    tracing.request(
                        context.invocation_metadata(), model=request.model_name, version=version, request_id=request_id
                    )
                )
            try:
                parsed = converters.request_from_proto(request, max_elements=self.max_elements)
                rows = parsed.inputs[0].shape[0] if parsed.inputs and parsed.inputs[0].shape else 0
                response = self.plane.infer(parsed)
                version, served = response.model_version, response.served
                with tracing.postprocess() if tracing is not None else contextlib.nullcontext():
                    answer = converters.response_to_proto(response, raw=parsed.raw_output)
            except ServingError as exc:
                code = exc.code.name
                raise
            except Exception:
                code = "INTERNAL"
                raise
            finally:
                elapsed = time.perf_counter() - start
                self.metrics.observe(request.model_name, version, code, elapsed)
                self._log(request, request_id, version, code, rows, elapsed, served)
        return answer

    def _log(
        self, request: Any, request_id: str, version: str, code: str, rows: int, elapsed: float, served: dict[str, Any]
    ) -> None:
        log = self.request_log
        if log is None or not log.wanted(request_id, code):
            return
        from serving.observability.logs import input_hash
        from serving.observability.tracing import current_trace_id

        log.log(
            request_id=request_id,
            model_name=request.model_name,
            model_version=version,
            input_hash=input_hash(request.raw_input_contents) if request.raw_input_contents else None,
            runtime=served.get("runtime"),
            batch_size=rows,
            inference_time_ms=elapsed * 1e3,
            output_confidence=served.get("output_confidence"),
            abnormal_flag=bool(served.get("abnormal") or served.get("runtime") == "rules"),
            gpu_utilization=self.metrics.gpu.utilization() if hasattr(self.metrics, "gpu") else None,
            status=code,
            trace_id=current_trace_id(),
        )


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
