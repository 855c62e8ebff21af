"""Observability work that need not delay an answer, on one background thread that wakes on a tick.

A request's answer waits only for its metrics (a few histogram updates). Everything heavier happens
here, after the answer is on its way: each batch's drift features and output entropies (vectorised over
every batch since the last tick, the KS tests every ``drift_test_every`` images), and, through a tick
hook (``every_tick``), the request records queued since the last tick, written as JSON lines in a few
writes (serving/observability/logs.py ``RequestLogger.drain``).

Why a tick (``interval_s``, 50 ms) rather than waking the thread for every call: on a busy server the
thread was woken thousands of times a second, and every wake-up is a GIL hand-off between it and the
request threads (a context switch on a small CPU). Measured on the 2-core benchmark VM, those hand-offs
cost several times the telemetry's own CPU. Submitting is now an append under an uncontended lock; the
thread takes everything queued once per tick, so the monitors also see many batches at once. And it
ticks only when there is work: the first call submitted (or record queued, ``poke``) after a tick wakes
it, and it gathers for one tick before running. An idle server's thread sleeps (ticking every 50 ms
regardless cost 0.15 % of a core idle), and with fewer batches a second than ticks (medium model: ~6) it
runs once per batch, not 20 times a second.

The queue is bounded, in calls (``max_pending``) and in the bytes they hold (``max_pending_bytes``, as
their submitters declare them): when the thread falls behind, new work is dropped and counted
(``sluicegate_telemetry_dropped_total``) rather than growing memory or slowing answers down. Tick hooks
keep their own bounded queues (the request records: ``sluicegate_request_records_dropped_total``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Item = tuple[str, Callable[..., None], tuple[Any, ...], int]


class TelemetryPipeline:
    """A bounded list of calls and the thread that runs them in order, once per tick.

    Args:
        max_pending: Most calls waiting; beyond it ``submit`` drops the call and returns False.
        max_pending_bytes: Most bytes the waiting calls may hold (as their submitters declare them).
        on_drop: Called (on the submitting thread) with the kind of every dropped call.
        interval_s: The tick: how long work may wait before the thread runs it.
    """

    def __init__(
        self,
        max_pending: int = 10_000,
        max_pending_bytes: int = 64 * 2**20,
        on_drop: Callable[[str], None] | None = None,
        *,
        interval_s: float = 0.05,
    ) -> None:
        if max_pending < 1 or max_pending_bytes < 0 or interval_s <= 0:
            raise ValueError(
                f"max_pending must be >= 1, max_pending_bytes >= 0 and interval_s > 0: "
                f"{max_pending}, {max_pending_bytes}, {interval_s}"
            )
        self._max_pending = max_pending
        self._max_bytes = max_pending_bytes
        self._interval = interval_s
        self._on_drop = on_drop
        self._lock = threading.Lock()  # guards _items and _bytes; held for an append or a swap
        self._items: list[Item] = []
        self._bytes = 0
        self._wake = threading.Event()  # flush and close: run now instead of at the next tick
        self._ready = threading.Event()  # something to run since the last tick: the thread sleeps until then
        self._hooks: list[tuple[str, Callable[[], Any]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="telemetry", daemon=True)
        self._thread.start()

    def submit(self, kind: str, fn: Callable[..., None], *args: Any, size: int = 0) -> bool:
        """Run ``fn(*args)`` on the telemetry thread; False (and counted) when the queue is full or closed.

        ``size``: the bytes the call keeps alive until it runs (a log line's request input)."""
        with self._lock:
            if self._closed or len(self._items) >= self._max_pending or self._bytes + size > self._max_bytes:
                accepted = False
            else:
                self._items.append((kind, fn, args, size))
                self._bytes += size
                accepted = True
        if accepted:
            self.poke()
        elif self._on_drop is not None:
            self._on_drop(kind)
        return accepted

    def poke(self) -> None:
        """Tell the thread there is work for its tick hooks (a request record queued): it runs a tick within
        ``interval_s``. Cheap when it already knows (a flag read), so callable once per request."""
        if not self._ready.is_set():
            self._ready.set()

    def every_tick(self, kind: str, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` on the telemetry thread at every tick, before the calls submitted since the last
        one (so ``flush`` and ``close`` also wait for what it drains). For work that queues itself more
        cheaply than a ``submit`` per item: the request records. The thread ticks only when there is work,
        so whoever queues for ``fn`` calls ``poke`` after."""
        with self._lock:
            self._hooks = [*self._hooks, (kind, fn)]

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything submitted before this call has run; False if ``timeout`` ran out."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        with self._lock:
            self._items.append(("flush", done.set, (), 0))
        self._wake.set()
        self._ready.set()
        return done.wait(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Run what is queued, then stop the thread (new submissions are dropped from now on)."""
        with self._lock:
            self._closed = True
        self._wake.set()
        self._ready.set()
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            self._ready.wait()
            self._wake.wait(self._interval)  # gather for up to a tick
            self._wake.clear()
            self._ready.clear()  # before taking the work: what comes after sets it again
            with self._lock:
                items, self._items = self._items, []
                closed = self._closed
                hooks = self._hooks
            # Hooks first: what a hook drains was queued before any flush marker taken in this swap.
            for kind, hook in hooks:
                try:
                    hook()
                except Exception:  # a broken sink must not stop the monitors
                    log.exception("telemetry %s failed; the next tick goes on", kind)
            items.reverse()  # popped from the end, in submission order
            while items:
                kind, fn, args, size = items.pop()  # popped: nothing keeps a done call's request alive
                try:
                    fn(*args)
                except Exception:  # one bad batch or line must not stop the monitors
                    log.exception("telemetry %s failed; the next one goes on", kind)
                finally:
                    if size:
                        with self._lock:
                            self._bytes -= size
                # A loop variable outlives its loop: the last call's arguments (a request of up to
                # max_message_bytes) would stay referenced until the next one ran, maybe never.
                del fn, args
            if closed:
                return
