"""Dynamic batching for one model version: many small requests in, one runtime call per batch out.

Request threads (the data plane, for either transport) call ``call`` and block until their rows are back
(``submit`` returns a future instead); one worker thread per model version takes what is queued,
concatenates compatible requests along the batch axis, runs the batch-first runtime once and hands every
request its own rows back.

Measured on grpcio (shared FACTS, "Serving on grpcio"): batching saves per-request overhead rather than
compute, a small batch cap beats a large one, and a batching timer makes single requests much slower
while gaining nothing under load. So the default worth configuring is ``max_queue_delay_us=0``: batch
what is already queued, never wait for more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from serving.errors import InvalidInput, ModelNotReady, Overloaded, RuntimeFailure

logger = logging.getLogger(__name__)

Array = npt.NDArray[Any]
Batch = dict[str, Array]
RunFn = Callable[[dict[str, Array]], dict[str, Array]]
# Per input, sorted by name: what must match for two requests to share one concatenated batch.
Signature = tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]


@dataclass(frozen=True)
class BatcherStats:
    """Counters since the batcher started (Triton-style model statistics).

    ``requests``, ``rows`` and ``batches`` count work that ran, whether it succeeded or not;
    ``failures`` is the number of those requests that got an error, so successes are the difference.
    """

    requests: int
    rows: int
    batches: int
    failures: int
    rejected: int  # refused with Overloaded because the queue was full
    cancelled: int  # cancelled by the caller before a batch took them; they never ran
    queued: int  # waiting now (not counting the batch being run)
    peak_queued: int  # the most ever waiting at once; never above max_queue_size
    queue_ns_total: int  # summed over requests: submit -> its batch starts
    exec_ns_total: int  # summed over batches: concatenate + run + split
    last_inference_ms: int  # epoch milliseconds when the last batch finished; 0 before the first


class BatchObserver(Protocol):
    """Receives one call per batch, from the worker thread, after the batch's futures are resolved.

    Meant for histograms (batch size, queue time per request, execution time). It runs on the worker
    between batches, so it should be quick; exceptions are logged and swallowed.
    """

    def on_batch(self, batch_rows: int, queue_ns: Sequence[int], exec_ns: int, ok: bool) -> None: ...


class BatchTracer(Protocol):
    """Spans around a batch's runtime call (serving.observability.tracing.RequestTracing fits), so the
    batcher needs no tracing library of its own."""

    def batch(self, traces: Sequence[Any], *, runtime: str, batch_rows: int) -> AbstractContextManager[None]: ...


class _Slot:
    """What ``call`` waits on: the three methods of ``Future`` the worker uses, on one lock.

    ``concurrent.futures.Future`` builds a Condition per request and notifies through it; handing one
    lock from the worker to the waiting thread does the same job for a caller that can only block (no
    cancel, no callbacks) at a fraction of the cost, which counts at thousands of requests a second.
    """

    __slots__ = ("_done", "error", "value")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.value: Batch | None = None
        self.error: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        return True  # a blocked caller cannot cancel

    def set_result(self, value: Batch) -> None:
        self.value = value
        self._done.release()

    def set_exception(self, error: BaseException) -> None:
        self.error = error
        self._done.release()

    def wait(self) -> Batch:
        self._done.acquire()
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


class _Request:
    __slots__ = ("count", "enqueued_ns", "future", "inputs", "rows", "signature", "trace")

    def __init__(
        self,
        inputs: Batch,
        rows: int,
        signature: Signature,
        trace: Any = None,
        slot: _Slot | None = None,
        count: int = 1,
    ) -> None:
        self.count = count  # callers this request stands for (the native front end's lanes send several)
        self.trace = trace
        self.inputs = inputs
        self.rows = rows
        self.signature = signature
        self.future: Future[Batch] | _Slot = Future() if slot is None else slot
        self.enqueued_ns = time.monotonic_ns()


class DynamicBatcher:
    """Queues requests for one model version and runs them in batches on one worker thread.

    Args:
        run: The batch-first runtime call: ``{input name: array with leading batch axis}`` to
            ``{output name: array with the same leading dimension}``.
        max_batch_size: Most rows in one batch; a request is never split across batches.
        max_queue_delay_us: How long the worker may wait for more requests when a batch is below the
            cap, counted from the oldest request's arrival. 0 (recommended) never waits.
        max_queue_size: Most requests waiting; beyond it ``submit`` raises ``Overloaded``.
        name: The worker thread's name; also names the model version in error messages.
        observer: Optional per-batch callback for metrics.
        tracer: Optional spans around each batch's runtime call.
        runtime_name: The runtime level's name for the spans.
        on_outputs: Called on the worker with ``(inputs, outputs)`` of every successful batch, after its
            callers have their answers (monitors that look at whole batches: drift, output entropy).
            It must not modify the arrays; exceptions are logged and swallowed.
    """

    def __init__(
        self,
        run: RunFn,
        *,
        max_batch_size: int,
        max_queue_delay_us: int,
        max_queue_size: int,
        name: str,
        observer: BatchObserver | None = None,
        tracer: BatchTracer | None = None,
        runtime_name: Callable[[], str] | None = None,
        on_outputs: Callable[[Batch, Batch], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be 0 or more, got {max_queue_delay_us}")
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be at least 1, got {max_queue_size}")
        self._run = run
        self._tracer, self._runtime_name = tracer, runtime_name
        self._max_rows = max_batch_size
        self._delay_ns = max_queue_delay_us * 1000
        self._max_queued = max_queue_size
        self.name = name
        self._observer = observer
        self._on_outputs = on_outputs
        # Submitters hand requests over through a SimpleQueue (put/get in C, no Python-level Condition
        # on the hot path); None is the stop sentinel. The worker moves them into ``_pending``, which
        # only it touches, to pick compatible requests out of order.
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._pending: deque[_Request] = deque()
        # Guards admission (depth, stopping) and the counters; held for a few bytecodes at a time.
        self._lock = threading.Lock()
        self._depth = 0  # requests in the inbox or pending: what max_queue_size bounds
        self._stopping = False
        self._requests = self._rows = self._batches = self._failures = 0
        self._rejected = self._cancelled = self._peak_queued = 0
        self._queue_ns_total = self._exec_ns_total = self._last_inference_ms = 0
        # Held by whoever runs a batch: the worker, or a caller of ``call`` that found the worker idle.
        self._runner = threading.Lock()
        self._worker_waiting = False  # the worker is blocked on an empty inbox (read without a lock: a hint)
        self._lone = True  # the last batch had one request (see ``call``); a hint like _worker_waiting
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, inputs: Mapping[str, Array], trace: Any = None, count: int = 1) -> Future[Batch]:
        """Queue one request; the future resolves to its own rows of every output.

        Args:
            inputs: Input name to array, each with the same leading batch dimension n >= 1.
            trace: the request's queued-trace handle, given to the tracer with its batch.
            count: The callers these rows belong to, for the statistics (as for ``call``).

        Returns:
            A future of ``{output name: array}`` with n rows each, owned by this request.

        Raises:
            InvalidInput: No inputs, a scalar input, disagreeing or zero batch dimensions, or
                n > max_batch_size.
            Overloaded: ``max_queue_size`` requests are already waiting.
            ModelNotReady: ``stop()`` was called.
        """
        arrays, rows, signature = self._admit(inputs)
        request = _Request(arrays, rows, signature, trace, count=count)
        self._enqueue(request)
        return request.future  # type: ignore[return-value]  # a Future: no slot was given

    def call(
        self, inputs: Batch, rows: int, signature: Signature, trace: Any = None, count: int = 1, batched: bool = False
    ) -> Batch:
        """Queue one already-checked request and block until its rows are back (the server's hot path).

        Args:
            inputs: Input name to array, every one with ``rows`` leading rows; not copied, so the caller
                must not change them.
            rows: The batch dimension, 1..max_batch_size.
            signature: ``signature(inputs)``; precomputed by callers whose inputs have fixed shapes.
            trace: As for ``submit``.
            count: The callers these rows belong to, for the statistics (serving/native: a lane's
                requests run as one); 1 otherwise.
            batched: The rows are a batch already (a native lane's): run them on this thread whenever the
                worker is idle, not only after a lone request (see below).

        Raises:
            The errors of ``submit``, and the runtime's error for this request's batch.
        """
        if rows < 1 or rows > self._max_rows:
            raise InvalidInput(f"model {self.name}: batch size {rows}; expected 1 to {self._max_rows} (max_batch_size)")
        slot = _Slot()
        request = _Request(inputs, rows, signature, trace, slot, count)
        if (self._lone or batched) and not self._delay_ns and self.worker_idle and self._runner.acquire(blocking=False):
            # The worker sleeps on an empty queue and the last batch was a lone request: run this one
            # here. Handing a lone request to the worker and back costs two thread wake-ups and two GIL
            # hand-offs (c=1: +5 % throughput when run here). Not after a batch of several: under load the
            # queue is empty only for the moment between two batches, and a request run here alone (the
            # worker waiting on it) made the mean batch 2.9-3.6 rows instead of 6.6-6.8 at c=32 with a cap
            # of 8, 7 % fewer inferences a second (c=8: 11 %). Never with a queue delay: there a lone request waits up
            # to max_queue_delay_us for company (Triton's meaning), on the worker. A native lane's batch formed
            # already (the rows of every caller queued in C++): handing it over would only add the wake-ups.
            try:
                if self._idle():
                    with self._lock:
                        if self._stopping:
                            raise ModelNotReady(
                                f"model {self.name} is stopping and takes no new requests; retry on another version"
                            )
                    self._execute([request], rows)
                    return slot.wait()  # resolved by _execute: returns at once
            finally:
                self._runner.release()
        self._enqueue(request)
        return slot.wait()

    @property
    def worker_idle(self) -> bool:
        """The worker sleeps on an empty queue (a ``call`` now runs on its caller's thread if the last
        batch was a lone request)."""
        return self._worker_waiting and self._idle()

    def _idle(self) -> bool:
        """Nothing waiting for the worker (its inbox and its pending list are both empty)."""
        return self._inbox.empty() and not self._pending

    def _enqueue(self, request: _Request) -> None:
        with self._lock:
            if self._stopping:
                raise ModelNotReady(
                    f"model {self.name} is stopping and takes no new requests; retry on another version"
                )
            depth = self._depth
            if depth >= self._max_queued:
                self._rejected += 1
                raise Overloaded(
                    f"model {self.name}: queue is full ({depth} requests waiting, max_queue_size {self._max_queued});"
                    " retry later"
                )
            self._depth = depth + 1
            if depth >= self._peak_queued:
                self._peak_queued = depth + 1
            # Under the lock, so nothing can follow stop()'s sentinel into the inbox.
            self._inbox.put(request)

    def stop(self, timeout: float | None = None) -> bool:
        """Refuse new requests, finish every queued one, and join the worker.

        Args:
            timeout: Seconds to wait for the drain; None waits as long as it takes.

        Returns:
            True when the worker has finished; False when the timeout ran out first (call again to
            keep waiting).
        """
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._inbox.put(None)
        if threading.current_thread() is self._thread:  # a run function stopping its own batcher
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stats(self) -> BatcherStats:
        with self._lock:
            return BatcherStats(
                requests=self._requests,
                rows=self._rows,
                batches=self._batches,
                failures=self._failures,
                rejected=self._rejected,
                cancelled=self._cancelled,
                queued=self._depth,
                peak_queued=self._peak_queued,
                queue_ns_total=self._queue_ns_total,
                exec_ns_total=self._exec_ns_total,
                last_inference_ms=self._last_inference_ms,
            )

    def _admit(self, inputs: Mapping[str, Array]) -> tuple[Batch, int, Signature]:
        if not inputs:
            raise InvalidInput(f"model {self.name}: a request needs at least one input tensor")
        # A private dict, so a caller reusing its mapping cannot change a queued request.
        arrays = {name: np.asarray(value) for name, value in inputs.items()}
        rows = -1
        parts = []
        for name, array in arrays.items():
            shape = array.shape
            if not shape:
                raise InvalidInput(f"model {self.name}: input {name!r} is a scalar; it needs a leading batch axis")
            if rows == -1:
                rows = shape[0]
            elif shape[0] != rows:
                found = {n: a.shape[0] for n, a in arrays.items()}
                raise InvalidInput(
                    f"model {self.name}: inputs disagree on the batch size: {found}; send equal leading dims"
                )
            parts.append((name, array.dtype, shape[1:]))
        if rows < 1:
            raise InvalidInput(f"model {self.name}: batch size 0; send at least one row")
        if rows > self._max_rows:
            raise InvalidInput(
                f"model {self.name}: batch size {rows} exceeds max_batch_size {self._max_rows}; split the request"
            )
        return arrays, rows, _signature(parts)

    def _work(self) -> None:
        pending = self._pending
        stopping = False
        try:
            while pending or not stopping:
                if not pending:
                    self._worker_waiting = True
                    item = self._inbox.get()  # idle: block until work or the stop sentinel
                    self._worker_waiting = False
                    if item is None:
                        stopping = True
                        continue
                    pending.append(item)
                with self._runner:  # a caller running a lone request inline finishes first
                    stopping = self._drain() or stopping
                    batch, rows, cancelled, stopping = self._collect(stopping)
                    with self._lock:
                        self._depth -= len(batch) + cancelled
                        self._cancelled += cancelled
                    if batch:
                        self._execute(batch, rows)
        finally:
            self._abandon()

    def _abandon(self) -> None:
        """After a normal drain there is nothing left; if the worker itself broke, fail what is queued
        instead of leaving its callers blocked forever."""
        with self._lock:
            self._stopping = True
        leftover = list(self._pending)
        self._pending.clear()
        self._drain()
        leftover.extend(self._pending)
        for request in leftover:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(ModelNotReady(f"model {self.name}: batch worker stopped"))

    def _drain(self) -> bool:
        """Move everything the inbox holds now into ``_pending``; True if the stop sentinel was among it."""
        inbox, pending = self._inbox, self._pending
        # empty() rather than catching queue.Empty: this runs once per batch, usually on an empty inbox.
        # Safe because this thread is the only consumer.
        while not inbox.empty():
            item = inbox.get_nowait()
            if item is None:
                return True  # stop() puts it last: nothing can follow it
            pending.append(item)
        return False

    def _collect(self, stopping: bool) -> tuple[list[_Request], int, int, bool]:
        """The next batch from ``_pending``, with its rows, the cancelled requests dropped on the way,
        and whether the stop sentinel has been seen."""
        batch: list[_Request] = []
        signature = self._pending[0].signature
        rows, full, cancelled = self._take(batch, 0, signature)
        if not batch or full or stopping or not self._delay_ns:
            return batch, rows, cancelled, stopping
        # Bounded from the oldest request's arrival (Triton's max_queue_delay): a request that already
        # waited behind a long batch runs at once instead of waiting again.
        deadline = batch[0].enqueued_ns + self._delay_ns
        while not full and rows < self._max_rows:
            remaining = deadline - time.monotonic_ns()
            if remaining <= 0:
                break
            try:
                item = self._inbox.get(timeout=remaining / 1e9)
            except queue.Empty:
                break
            if item is None:
                return batch, rows, cancelled, True  # draining: run what we have now
            self._pending.append(item)
            stopping = self._drain()
            rows, full, more = self._take(batch, rows, signature)
            cancelled += more
            if stopping:
                break
        return batch, rows, cancelled, stopping

    def _take(self, batch: list[_Request], rows: int, signature: Signature) -> tuple[int, bool, int]:
        """Move pending requests matching ``signature`` into ``batch`` while they fit.

        Returns the batch's rows; whether it is full (the next matching request did not fit, so
        waiting cannot add to it); and how many cancelled requests were dropped. Requests of other
        signatures keep their place for the next batch.
        """
        pending = self._pending
        skipped: list[_Request] = []
        full = False
        cancelled = 0
        while pending and rows < self._max_rows:
            request = pending.popleft()
            if request.signature != signature:
                skipped.append(request)
                continue
            if rows + request.rows > self._max_rows:
                skipped.append(request)
                full = True  # FIFO within a signature: no smaller request jumps ahead of this one
                break
            if not request.future.set_running_or_notify_cancel():
                cancelled += 1
                continue
            batch.append(request)
            rows += request.rows
        if skipped:
            pending.extendleft(reversed(skipped))
        return rows, full, cancelled

    def _execute(self, batch: list[_Request], rows: int) -> None:
        start = time.monotonic_ns()
        queue_ns = [start - request.enqueued_ns for request in batch]
        results: list[Batch] = []
        error: BaseException | None = None
        inputs: Batch = {}
        outputs: Mapping[str, Array] = {}
        try:
            inputs = self._concatenate(batch)
            if self._tracer is None:
                outputs = self._run(inputs)
                results = self._split(outputs, batch, rows)
            else:
                runtime = self._runtime_name() if self._runtime_name else ""
                with self._tracer.batch([r.trace for r in batch], runtime=runtime, batch_rows=rows):
                    outputs = self._run(inputs)
                    results = self._split(outputs, batch, rows)
        except Exception as exc:  # the runtime's failure belongs to this batch's callers, not the worker
            error = exc
        exec_ns = time.monotonic_ns() - start
        self._lone = len(batch) == 1
        callers = sum(request.count for request in batch)
        with self._lock:
            self._requests += callers
            self._rows += rows
            self._batches += 1
            if error is not None:
                self._failures += callers
            self._queue_ns_total += sum(queue_ns)
            self._exec_ns_total += exec_ns
            self._last_inference_ms = time.time_ns() // 1_000_000
        if error is None:
            for request, result in zip(batch, results, strict=True):
                request.future.set_result(result)
        else:
            for request in batch:
                request.future.set_exception(error)
        if self._observer is not None:
            try:
                self._observer.on_batch(rows, queue_ns, exec_ns, error is None)
            except Exception:
                logger.exception("batch observer failed for model %s; batching goes on", self.name)
        if self._on_outputs is not None and error is None:
            try:
                self._on_outputs(inputs, dict(outputs))
            except Exception:
                logger.exception("batch output hook failed for model %s; batching goes on", self.name)

    @staticmethod
    def _concatenate(batch: list[_Request]) -> Batch:
        if len(batch) == 1:
            return dict(batch[0].inputs)
        return {name: np.concatenate([request.inputs[name] for request in batch]) for name in batch[0].inputs}

    def _split(self, outputs: Mapping[str, Array], batch: list[_Request], rows: int) -> list[Batch]:
        checked: dict[str, Array] = {}
        for name, value in outputs.items():
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != rows:
                raise RuntimeFailure(
                    f"model {self.name}: output {name!r} has shape {array.shape} but the batch has {rows} rows;"
                    " a batch-first runtime must return the batch size as the leading dimension"
                )
            checked[name] = array
        results: list[Batch] = []
        start = 0
        for request in batch:
            end = start + request.rows
            # Copies, even for a lone request: a view would keep the whole batch's buffer alive and share
            # it between callers, and a runtime may reuse its output buffers for the next batch. Outputs
            # are small (logits, boxes), so this costs far less than a corrupted answer.
            results.append({name: array[start:end].copy() for name, array in checked.items()})
            start = end
        return results


def signature(inputs: Mapping[str, Array]) -> Signature:
    """What must match for two requests to share a batch: each input's name, dtype and non-batch shape."""
    return _signature([(name, array.dtype, array.shape[1:]) for name, array in inputs.items()])


def _signature(parts: list[tuple[str, np.dtype[Any], tuple[int, ...]]]) -> Signature:
    # Sorted by name (names are unique, so dtypes are never compared): input order does not matter.
    return tuple(sorted(parts)) if len(parts) > 1 else tuple(parts)
