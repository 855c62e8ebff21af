"""Observability work that need not delay an answer, on one background thread.

A request's answer waits only for its metrics (a few histogram updates). Everything heavier happens
here, after the answer is on its way: each batch's drift features and output entropies (vectorised over
the batch, the KS tests every ``drift_test_every`` images) and each sampled request-log line (the sha256
of its inputs, the JSON). One thread rather than the request threads: the request log writes from one
place (no contention on the handler's lock), the monitors need no locks of their own in practice, and
the work is the same in CPU but off the requests' latency.

The queue is bounded, in calls (``max_pending``) and in the bytes they hold (``max_pending_bytes``: a
queued log line keeps its request's input alive until it is hashed): when the thread falls behind, new
work is dropped and counted (``sluicegate_telemetry_dropped_total``) rather than growing memory or
slowing answers down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class TelemetryPipeline:
    """A bounded queue of calls and the thread that runs them in order.

    Args:
        max_pending: Most calls waiting; beyond it ``submit`` drops the call and returns False.
        max_pending_bytes: Most bytes the waiting calls may hold (as their submitters declare them).
        on_drop: Called (on the submitting thread) with the kind of every dropped call.
    """

    def __init__(
        self,
        max_pending: int = 10_000,
        max_pending_bytes: int = 64 * 2**20,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        if max_pending < 1 or max_pending_bytes < 0:
            raise ValueError(f"max_pending must be >= 1 and max_pending_bytes >= 0: {max_pending}, {max_pending_bytes}")
        self._max_pending = max_pending
        self._max_bytes = max_pending_bytes
        self._bytes = 0
        self._bytes_lock = threading.Lock()
        self._on_drop = on_drop
        # SimpleQueue: put and qsize in C without a Condition, the cheapest hand-off from many threads.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="telemetry", daemon=True)
        self._thread.start()

    def submit(self, kind: str, fn: Callable[..., None], *args: Any, size: int = 0) -> bool:
        """Run ``fn(*args)`` on the telemetry thread; False (and counted) when the queue is full or closed.

        ``size``: the bytes the call keeps alive until it runs (a log line's request input)."""
        if self._closed or self._queue.qsize() >= self._max_pending:
            return self._drop(kind)
        if size:
            with self._bytes_lock:
                if self._bytes + size > self._max_bytes:
                    return self._drop(kind)
                self._bytes += size
        self._queue.put((kind, fn, args, size))
        return True

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def _drop(self, kind: str) -> bool:
        if self._on_drop is not None:
            self._on_drop(kind)
        return False

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything submitted before this call has run; False if ``timeout`` ran out."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(("flush", done.set, (), 0))
        return done.wait(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Run what is queued, then stop the thread (new submissions are dropped from now on)."""
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            kind, fn, args, size = item
            try:
                fn(*args)
            except Exception:  # one bad batch or line must not stop the monitors
                log.exception("telemetry %s failed; the next one goes on", kind)
            finally:
                if size:
                    with self._bytes_lock:
                        self._bytes -= size
            # Hand the GIL over between calls. Without this the thread runs item after item for a whole
            # switch interval (5 ms) while request threads wait to re-take the GIL after their I/O:
            # measured, a full request log cost twice its own CPU time in lost throughput.
            time.sleep(0)
