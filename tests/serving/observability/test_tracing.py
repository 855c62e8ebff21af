"""Spans with the SDK's InMemorySpanExporter: request > {queue, runtime, postprocess}, the runtime span
started on another thread, the trace continued from an incoming W3C traceparent (also over real gRPC)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import ExitStack
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from serving.observability.tracing import (
    QueuedTrace,
    RequestTracing,
    current_trace_id,
    extract_context,
    setup_tracing,
    trace_id,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"


@pytest.fixture
def exported() -> Iterator[tuple[RequestTracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("memory", service_name="test-serving", span_exporter=exporter)
    yield RequestTracing(provider), exporter
    provider.shutdown()


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def serve(tracing: RequestTracing, metadata: Any, *, fail: Exception | None = None) -> tuple[str | None, int]:
    """What the server does per request, with a worker thread standing in for the batcher's."""
    worker_thread: list[int] = []

    def run_batch(queued: Sequence[QueuedTrace | None]) -> str:
        worker_thread.append(threading.get_ident())
        with tracing.batch(queued, runtime="onnxruntime", batch_rows=4):
            if fail is not None:
                raise fail
            return "logits"

    with (
        futures.ThreadPoolExecutor(max_workers=1) as batcher,
        tracing.request(metadata, model="pcb", version="2", request_id="req-1") as span,
    ):
        with tracing.queued() as queued:
            batcher.submit(run_batch, [queued]).result()
        with tracing.postprocess():
            pass
        return trace_id(span), worker_thread[0]


def test_spans_nest_under_the_request_and_continue_the_callers_trace(
    exported: tuple[RequestTracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = exported
    logged_trace, worker = serve(tracing, [("traceparent", TRACEPARENT), ("user-agent", "grpc-python")])
    assert worker != threading.get_ident()
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"ModelInfer", "queue", "runtime", "postprocess"}
    request = spans["ModelInfer"]
    assert request.kind is SpanKind.SERVER
    assert request.parent is not None and request.parent.is_remote and f"{request.parent.span_id:016x}" == CALLER
    assert logged_trace == TRACE
    assert all(f"{span.context.trace_id:032x}" == TRACE for span in spans.values())
    for name in ("queue", "runtime", "postprocess"):
        parent = spans[name].parent
        assert parent is not None and parent.span_id == request.context.span_id, name
    queue, runtime, post = spans["queue"], spans["runtime"], spans["postprocess"]
    assert queue.end_time is not None and runtime.start_time is not None and runtime.end_time is not None
    assert post.start_time is not None and request.end_time is not None and request.start_time is not None
    assert request.start_time <= queue.start_time <= queue.end_time <= runtime.start_time  # type: ignore[operator]
    assert runtime.end_time <= post.start_time and post.end_time <= request.end_time  # type: ignore[operator]
    assert dict(runtime.attributes or {}) == {
        "sluicegate.runtime": "onnxruntime",
        "sluicegate.batch_size": 4,
        "sluicegate.batch_requests": 1,
    }
    assert request.attributes is not None and request.attributes["sluicegate.request_id"] == "req-1"
    assert request.resource.attributes["service.name"] == "test-serving"


def test_without_a_traceparent_the_request_starts_a_trace(
    exported: tuple[RequestTracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = exported
    for metadata in (None, [("traceparent", "00-not-a-trace-01")]):
        exporter.clear()
        logged_trace, _ = serve(tracing, metadata)
        request = by_name(exporter.get_finished_spans())["ModelInfer"]
        assert request.parent is None
        assert logged_trace is not None and logged_trace != TRACE


def test_one_batch_gives_each_request_its_runtime_span_in_its_own_trace(
    exported: tuple[RequestTracing, InMemorySpanExporter],
) -> None:
    """Two requests from two traces queued at once, then run as one batch on a worker thread."""
    tracing, exporter = exported
    traces = ["1" * 32, "2" * 32]
    queued: list[QueuedTrace] = []
    with ExitStack() as open_requests:
        for trace in traces:
            metadata = [("traceparent", f"00-{trace}-{CALLER}-01")]
            open_requests.enter_context(tracing.request(metadata, model="m", version="1", request_id=trace))
            queued.append(open_requests.enter_context(tracing.queued()))

        def run() -> None:
            with tracing.batch([*queued, None], runtime="tensorrt", batch_rows=3):  # None: sent untraced
                pass

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    spans = exporter.get_finished_spans()
    runtimes = [span for span in spans if span.name == "runtime"]
    assert sorted(f"{span.context.trace_id:032x}" for span in runtimes) == traces
    assert all((span.attributes or {})["sluicegate.batch_requests"] == 3 for span in runtimes)
    for runtime in runtimes:
        (request,) = [s for s in spans if s.name == "ModelInfer" and s.context.trace_id == runtime.context.trace_id]
        assert runtime.parent is not None and runtime.parent.span_id == request.context.span_id
    assert len([span for span in spans if span.name == "queue"]) == 2  # each ended once


def test_failures_mark_the_spans(exported: tuple[RequestTracing, InMemorySpanExporter]) -> None:
    tracing, exporter = exported
    with pytest.raises(RuntimeError, match="engine"):
        serve(tracing, [("traceparent", TRACEPARENT)], fail=RuntimeError("engine lost"))
    spans = by_name(exporter.get_finished_spans())
    assert spans["runtime"].status.status_code is StatusCode.ERROR
    assert spans["ModelInfer"].status.status_code is StatusCode.ERROR
    assert spans["queue"].status.status_code is StatusCode.UNSET  # it ran; it was the runtime that failed
    exporter.clear()
    # Refused before a batch took it (queue full): the queue span ends here, with the error.
    with (
        pytest.raises(OSError, match="full"),
        tracing.request(None, model="m", version="1", request_id="r"),
        tracing.queued(),
    ):
        raise OSError("queue full")
    queue = by_name(exporter.get_finished_spans())["queue"]
    assert queue.status.status_code is StatusCode.ERROR and queue.end_time is not None


def test_none_exporter_records_nothing_but_keeps_the_trace_id() -> None:
    provider = setup_tracing("none")
    tracing = RequestTracing(provider)
    with tracing.request([("traceparent", TRACEPARENT)], model="m", version="1", request_id="r") as span:
        assert not span.is_recording()
        assert trace_id(span) == TRACE
        assert current_trace_id() == TRACE  # what the data plane puts in the request log
    assert current_trace_id() is None


def test_otlp_exporter_is_built_lazily_and_unknown_ones_refused() -> None:
    provider = setup_tracing("otlp", "http://127.0.0.1:4317", "svc")
    assert isinstance(provider, TracerProvider)
    provider.shutdown()  # nothing was recorded: nothing to send
    with pytest.raises(ValueError, match="tracing exporter"):
        setup_tracing("jaeger")  # type: ignore[arg-type]


def test_traceparent_from_real_grpc_invocation_metadata() -> None:
    """A real gRPC server reads the caller's trace from ``context.invocation_metadata()``."""
    seen: list[str | None] = []

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        tracing = RequestTracing(setup_tracing("none"))
        with tracing.request(context.invocation_metadata(), model="m", version="1", request_id="r") as span:
            seen.append(trace_id(span))
        return b""

    method: Callable[..., bytes] = handler
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("probe.Probe", {"Call": grpc.unary_unary_rpc_method_handler(method)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/probe.Probe/Call")
            call(b"", metadata=[("traceparent", TRACEPARENT), ("tracestate", "vendor=1")], timeout=10)
            call(b"", timeout=10)
    finally:
        server.stop(None)
    assert seen[0] == TRACE and seen[1] not in (None, TRACE)


def test_extract_ignores_binary_and_unrelated_metadata() -> None:
    context = extract_context([("traceparent-bin", b"\x00"), ("authorization", "Bearer x")])
    assert context == {}
