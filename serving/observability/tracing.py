"""OpenTelemetry spans of an inference request: ``request`` with its ``queue``, ``runtime`` and
``postprocess`` spans as children, in that order in time.

The request span continues the caller's trace: its parent comes from the W3C ``traceparent`` /
``tracestate`` gRPC metadata. The queue and runtime spans end and start on the batcher's worker thread,
where the request thread's contextvars are not visible, so the request thread hands a ``QueuedTrace``
(its context and the open queue span) along with the queued request, and the worker starts the runtime
span with that context as an explicit parent.

Three children rather than a chain (request > queue > runtime > postprocess): a chain would make each
span a child of one that has already ended, which trace viewers draw as nonsense. Timing is the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

Exporter = Literal["otlp", "none", "memory"]
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C only, whatever OTEL_PROPAGATORS says


def setup_tracing(
    exporter: Exporter,
    endpoint: str | None = None,
    service_name: str = "sluicegate-serving",
    *,
    span_exporter: SpanExporter | None = None,
) -> TracerProvider:
    """The server's tracer provider (not installed globally: pass it to ``RequestTracing``).

    Args:
        exporter: "otlp": batched export over OTLP/gRPC to ``endpoint``; "memory": synchronous export to
            ``span_exporter`` (tests: an ``InMemorySpanExporter``); "none": nothing is recorded, but
            spans still carry the caller's trace id (or a new one), so request logs keep ``trace_id``.
        endpoint: OTLP collector, e.g. ``http://otel-collector:4317`` (``http://``: plaintext);
            None: the exporter's default (localhost:4317).
        service_name: The ``service.name`` resource attribute.
        span_exporter: Where "memory" exports; ignored otherwise.

    Raises:
        ValueError: an unknown exporter.
    """
    resource = Resource({SERVICE_NAME: service_name})  # not Resource.create: no environment reads
    if exporter == "none":
        return TracerProvider(sampler=ALWAYS_OFF, resource=resource, shutdown_on_exit=False)
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON), resource=resource)
    if exporter == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        provider.add_span_processor(SimpleSpanProcessor(span_exporter or InMemorySpanExporter()))
    elif exporter == "otlp":
        # Imported here: the exporter pulls in its protobuf messages, which a server without tracing skips.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        raise ValueError(f"tracing exporter must be 'otlp', 'none' or 'memory', got {exporter!r}")
    return provider


def extract_context(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (``context.invocation_metadata()``):
    ``traceparent`` and ``tracestate``; an empty context when absent or malformed."""
    carrier = {
        str(key).lower(): value
        for key, value in (metadata or ())
        if isinstance(value, str) and str(key).lower() in ("traceparent", "tracestate")
    }
    return _PROPAGATOR.extract(carrier, context=Context()) if carrier else Context()


def trace_id(span: Span) -> str | None:
    """The span's trace id as 32 hex digits (the request log's ``trace_id``); None if invalid."""
    span_context = span.get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


def incoming_trace_id(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The caller's trace id from its W3C ``traceparent`` metadata (32 hex digits), or None; what the
    request log records when the server itself records no spans."""
    span_context = trace.get_current_span(extract_context(metadata)).get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


def current_trace_id() -> str | None:
    """The trace id of the span current in this thread (inside ``RequestTracing.request``), or None."""
    return trace_id(trace.get_current_span())


class QueuedTrace:
    """Travels with a queued request to the batcher thread: the request's context and its queue span."""

    __slots__ = ("_lock", "_queue_ended", "parent", "queue_span")

    def __init__(self, parent: Context, queue_span: Span) -> None:
        self.parent = parent
        self.queue_span = queue_span
        self._lock = threading.Lock()
        self._queue_ended = False

    def end_queue(self, end_ns: int | None = None, error: BaseException | None = None) -> None:
        """End the queue span once; later calls do nothing (the worker and the request thread may race)."""
        with self._lock:
            if self._queue_ended:
                return
            self._queue_ended = True
        if error is not None:
            self.queue_span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.queue_span.end(end_time=end_ns)


class RequestTracing:
    """Span helpers for the request path (request thread) and the batch path (worker thread)."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer("serving")
        # False for setup_tracing("none"): its spans are never recorded, so the server makes none at all.
        self.recording = getattr(provider, "sampler", None) is not ALWAYS_OFF

    @contextmanager
    def request(
        self, metadata: Iterable[tuple[str, Any]] | None, *, model: str, version: str, request_id: str
    ) -> Iterator[Span]:
        """The request span (kind SERVER), current inside the block, child of the caller's span if any.
        An exception leaving the block is recorded on it and sets its status to ERROR."""
        attributes: dict[str, AttributeValue] = {
            "sluicegate.model": model,
            "sluicegate.version": version,
            "sluicegate.request_id": request_id,
        }
        with self._tracer.start_as_current_span(
            "ModelInfer", context=extract_context(metadata), kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    @contextmanager
    def queued(self) -> Iterator[QueuedTrace]:
        """Request thread, inside ``request``: start the queue span and yield what to hand the batcher.

        Wrap the submit and the wait for the result. The worker ends the queue span when the batch
        starts (``batch``); if the request never ran (queue full, cancelled, model unloading), the span
        is ended here with the error.
        """
        parent = context_api.get_current()
        queued = QueuedTrace(parent, self._tracer.start_span("queue", context=parent))
        try:
            yield queued
        except BaseException as exc:
            queued.end_queue(error=exc)
            raise
        queued.end_queue()

    @contextmanager
    def batch(self, traces: Sequence[QueuedTrace | None], *, runtime: str, batch_rows: int) -> Iterator[None]:
        """Worker thread, around the runtime call of one batch: ends every request's queue span now and
        gives each request a ``runtime`` span (child of its request span) for the call.

        Args:
            traces: The batch's requests' ``QueuedTrace`` (None for requests sent without one).
            runtime: The runtime level running the batch (tensorrt, onnxruntime, rules).
            batch_rows: Rows in the batch.
        """
        start = time.time_ns()
        present = [queued for queued in traces if queued is not None]
        attributes: dict[str, AttributeValue] = {
            "sluicegate.runtime": runtime,
            "sluicegate.batch_size": batch_rows,
            "sluicegate.batch_requests": len(traces),
        }
        spans = []
        for queued in present:
            queued.end_queue(start)
            spans.append(
                self._tracer.start_span("runtime", context=queued.parent, start_time=start, attributes=attributes)
            )
        try:
            yield
        except BaseException as exc:
            for span in spans:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            end = time.time_ns()
            for span in spans:
                span.end(end_time=end)

    @contextmanager
    def postprocess(self) -> Iterator[Span]:
        """Request thread, inside ``request``: the span for turning outputs into the answer."""
        with self._tracer.start_as_current_span("postprocess") as span:
            yield span
