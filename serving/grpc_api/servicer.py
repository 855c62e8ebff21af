"""The gRPC servicers: KServe V2 ``inference.GRPCInferenceService`` (with Triton's ModelConfig and
ModelStatistics extensions, so Triton's clients and perf_analyzer work) and the traffic admin service.
Each method converts (serving/grpc_api/converters.py, converters_meta.py), calls the data plane, converts
back; errors are mapped by serving/grpc_api/rpc_errors.py. ModelInfer takes the fast path of
serving/grpc_api/fast_infer.py for requests of the common form."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

import grpc

from serving.auth import Authorizer
from serving.batching import BatcherStats, signature
from serving.dataplane import DataPlane
from serving.errors import ModelNotReady, ServingError, clip
from serving.grpc_api import converters, converters_meta, fast_infer
from serving.observability.logs import input_digest, raw_digest
from serving.observability.metrics import ServerMetrics
from serving.observability.tracing import current_trace_id
from serving.proto import admin_pb2, admin_pb2_grpc, grpc_service_pb2, grpc_service_pb2_grpc

log = logging.getLogger(__name__)

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
PEER_KEY = "x-sluicegate-peer"  # serving/native/front.cc kPeerKey


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
        auth: Authorizer | None = None,
        behind_front: bool = False,
    ):
        self.plane, self.metrics = dataplane, metrics
        self.peer = front_peer if behind_front else own_peer
        telemetry = dataplane.telemetry
        self.tracing: Any = telemetry.tracing if telemetry is not None else None
        self.pipeline: Any = telemetry.pipeline if telemetry is not None else None
        # The request records are written by the telemetry thread: without telemetry there are none.
        self.request_log: Any = request_log if self.pipeline is not None else None
        if self.request_log is not None:
            self._connect_records(self.request_log, dataplane.settings, metrics)
        self.name, self.version, self.max_elements = name, version, max_elements
        self.auth = auth or Authorizer(None)
        self.echo = dataplane.settings.max_echo_chars

    def _connect_records(self, request_log: Any, settings: Any, metrics: ServerMetrics) -> None:
        """Point the request records at their sink (``request_log_file``, else standard error), bound them
        like the rest of the telemetry, count drops, and drain them at every telemetry tick."""
        from serving.observability.logs import LineSink

        request_log.configure(
            sink=LineSink.open(settings.request_log_file) if settings.request_log_file else None,
            max_pending=settings.telemetry_max_pending,
            on_drop=metrics.records_dropped.inc,
            gpu_utilization=metrics.gpu.utilization,
            on_queued=self.pipeline.poke,
        )
        self.pipeline.every_tick("records", request_log.drain)

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
        self.auth.read(authorization(context), peer=self.peer(context), action="RepositoryIndex")
        entries = [e for e in self.plane.index() if not request.ready or e.state == "READY"]
        return converters_meta.repository_index_to_proto(entries)

    def RepositoryModelLoad(self, request: Any, context: grpc.ServicerContext) -> Any:
        peer = self.peer(context)
        self.auth.change(authorization(context), peer=peer, action="RepositoryModelLoad")
        self.plane.load_model(request.model_name)
        # Who changed what is served, for the audit trail: refusals are logged by the Authorizer.
        log.info("RepositoryModelLoad of %r by %s", clip(request.model_name, self.echo), peer)
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request: Any, context: grpc.ServicerContext) -> Any:
        peer = self.peer(context)
        self.auth.change(authorization(context), peer=peer, action="RepositoryModelUnload")
        self.plane.unload_model(request.model_name)
        log.info("RepositoryModelUnload of %r by %s", clip(request.model_name, self.echo), peer)
        return pb.RepositoryModelUnloadResponse()

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        model, version = request.model_name, request.model_version
        # An empty id must not share one sampling decision (nor one lineage record) with every other.
        request_id = request.id or secrets.token_hex(16)
        tracing = self.tracing
        if tracing is None:  # the default: no span to open, so no ExitStack per request either
            return self._answer(request, context, request_id, start, None)
        echo = self.echo  # span attributes are exported: the caller's text is cut like in logs
        cut = {"model": clip(model, echo), "version": clip(version, echo), "request_id": clip(request_id, echo)}
        with tracing.request(context.invocation_metadata(), **cut):
            return self._answer(request, context, request_id, start, tracing)

    def _answer(self, request: Any, context: grpc.ServicerContext, request_id: str, start: float, tracing: Any) -> Any:
        """The answer, with the status the metrics and the record count (ServingError's, else INTERNAL)."""
        served = _Served()
        try:
            return self._infer(request, served, tracing)
        except ServingError as exc:
            served.code = exc.code.name
            raise
        except Exception:
            served.code = "INTERNAL"
            raise
        finally:
            self._finish(request, context, request_id, served, start)

    def _finish(
        self, request: Any, context: grpc.ServicerContext, request_id: str, served: _Served, start: float
    ) -> None:
        """The request's metrics and record, once its answer (or error) is decided."""
        elapsed = time.perf_counter() - start
        # What the client saw when it stopped waiting, not what the handler computed after.
        if context.time_remaining() <= 0:
            served.code = "DEADLINE_EXCEEDED"
        elif not context.is_active():
            served.code = "CANCELLED"
        self.metrics.observe(request.model_name, served.version or request.model_version, served.code, elapsed)
        request_log = self.request_log
        if request_log is not None and request_log.wanted(request_id, served.code):
            self._record(request, context, request_id, served, elapsed)

    def _infer(self, request: Any, served: _Served, tracing: Any) -> Any:
        model, version = request.model_name, request.model_version
        parsed = None
        for attempt in (0, 1):
            loaded = self.plane.route(model, version)
            served.version = loaded.version  # an error from here on counts against the version that failed
            plan = loaded.plan or self._plan(loaded)
            decoded = plan.decode(request, self.max_elements)
            if decoded is None:
                # Anything but the common form (typed contents, BYTES, parameters, another order, a mistake):
                # the general converters, checked against the routed version's inputs before decoding.
                parsed = converters.request_from_proto(request, max_elements=self.max_elements, expected=loaded.inputs)
                served.parsed = parsed
                inputs = self.plane.validate(loaded, parsed.inputs)
                served.rows = next(iter(inputs.values())).shape[0]
                sig = signature(inputs)
            else:
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
            if parsed is not None:
                return converters.response_to_proto(self.plane.response(loaded, parsed, outputs), raw=parsed.raw_output)
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

    def _record(
        self, request: Any, context: grpc.ServicerContext, request_id: str, served: _Served, elapsed: float
    ) -> None:
        """Queue the request's record: a tuple and the input digest (XXH3 runs at memory speed, ~1 us
        for a small model's 48 KiB, so nothing of the request outlives its call); the confidence, the
        trace id of a caller's traceparent and the JSON are made on the telemetry thread, per tick."""
        raw = request.raw_input_contents
        if raw:
            digest: str | None = raw_digest(raw)
        elif served.parsed is not None:
            digest = input_digest(tensor.data for tensor in served.parsed.inputs)
        else:
            digest = _typed_digest(request)
        tracing = self.tracing
        ok = served.code == "OK"
        self.request_log.record(
            (
                time.time(),
                request_id,
                request.model_name,
                served.version or request.model_version,
                digest,
                served.runtime if ok else None,
                served.rows or _rows(request),
                elapsed,
                served.code,
                current_trace_id() if tracing is not None else None,
                None if tracing is not None else context.invocation_metadata(),
                served.logits,
                served.monitors,
            )
        )


class _Served:
    """What one ModelInfer call learned on the way, for its metrics and its log line."""

    __slots__ = ("code", "logits", "monitors", "parsed", "rows", "runtime", "version")

    def __init__(self) -> None:
        self.code = "OK"
        self.parsed: Any = None  # the general path's decoded request (its tensors give the digest)
        self.rows = 0
        self.version = ""
        self.runtime: str | None = None
        self.logits: Any = None
        self.monitors: Any = None


def _rows(request: Any) -> int:
    return int(request.inputs[0].shape[0]) if request.inputs and request.inputs[0].shape else 0


def _typed_digest(request: Any) -> str | None:
    """The input digest of a request sent with typed contents that failed before it was decoded: its
    decoded arrays, digested as raw bytes; None when it cannot be decoded at all."""
    try:
        parsed = converters.request_from_proto(request)
    except ServingError:
        return None  # a request refused at decoding has no inputs to speak of
    return input_digest(tensor.data for tensor in parsed.inputs)


class AdminServicer(admin_pb2_grpc.TrafficAdminServicer):
    """Traffic weights over gRPC; the caller sends ``authorization: Bearer <token>`` metadata."""

    def __init__(self, dataplane: DataPlane, auth: Authorizer, *, behind_front: bool = False) -> None:
        self.plane, self.auth = dataplane, auth
        self.peer = front_peer if behind_front else own_peer

    def SetTrafficWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.auth.change(authorization(context), peer=self.peer(context), action="SetTrafficWeights")
        weights = self.plane.set_weights(request.model_name, dict(request.weights))
        return admin_pb2.TrafficWeightsResponse(model_name=request.model_name, weights=weights)

    def GetTrafficWeights(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.auth.read(authorization(context), peer=self.peer(context), action="GetTrafficWeights")
        weights = self.plane.weights(request.model_name)
        return admin_pb2.TrafficWeightsResponse(model_name=request.model_name, weights=weights)


def own_peer(context: grpc.ServicerContext) -> str:
    """The caller's address, as grpcio saw the connection."""
    return str(context.peer())


def front_peer(context: grpc.ServicerContext) -> str:
    """The caller's address behind the native front end (serving/native), which sets ``PEER_KEY`` on every
    call it passes on (dropping a caller's own) over a socket only this user can reach."""
    for key, value in context.invocation_metadata():
        if key == PEER_KEY:
            return str(value)
    return str(context.peer())


def authorization(context: grpc.ServicerContext) -> str | None:
    """The call's ``authorization`` metadata (gRPC lower-cases keys)."""
    for key, value in context.invocation_metadata():
        if key == "authorization":
            return str(value)
    return None


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
