"""Structured JSON logs: one JSON object per line.

``JsonFormatter`` formats every ``logging`` record of the server: a fixed envelope (timestamp, level,
logger, message) plus the request context bound with ``log_context`` (model, version, request id:
contextvars, so a warning logged deep in the data plane still names its request). Logging is configured
by the entry point (``json_handler``), never here at import.

Requests are not ``logging`` records: at thousands a second a record, a formatter and a lock per
request cost more than the inference of a small model. ``RequestLogger`` takes a tuple per request and
writes the lines in batches from the telemetry thread (``LineSink``), in the same JSON shape: the
envelope with ``logger`` = ``serving.requests``, then exactly ``REQUEST_FIELDS``, never tensors,
parameters or anything else from the request body. ``input_digest`` names the request's input bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from select import PIPE_BUF
from types import MappingProxyType
from typing import IO, Any

import numpy as np
import orjson
import xxhash

from serving.errors import ECHO_CHARS, clip

REQUEST_LOGGER = "serving.requests"
REQUEST_FIELDS = (
    "request_id",
    "model_name",
    "model_version",
    "input_digest",  # "xxh3-128:<32 hex>" (older lines: "input_hash", a bare sha256 hex)
    "runtime",
    "batch_size",
    "inference_time_ms",
    "output_confidence",
    "abnormal_flag",
    "gpu_utilization",
    "status",
    "trace_id",
)
ENVELOPE = ("timestamp", "level", "logger", "message")
_EMPTY: Mapping[str, str] = MappingProxyType({})
_context: ContextVar[Mapping[str, str]] = ContextVar("sluicegate_log_context", default=_EMPTY)


@contextmanager
def log_context(**fields: str) -> Iterator[None]:
    """Add ``fields`` (e.g. ``request_id=..., model=..., version=...``) to every record logged inside."""
    token = _context.set(MappingProxyType({**_context.get(), **fields}))
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: the envelope, then the bound context, then the traceback
    (``exception``) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update(_context.get())
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            payload["stack"] = self.formatStack(record.stack_info)
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)


def json_handler(stream: IO[str] | None = None, *, flush_interval_s: float = 0.0) -> logging.Handler:
    """A stream handler (stderr by default) with ``JsonFormatter``, for the entry point to install.

    ``flush_interval_s`` > 0 flushes at most that often (and at once for warnings and errors): with a
    line per request, a flush per line was a write system call per request, a measurable share of a
    small model's CPU. Give it a buffered stream (``buffered_stderr()``) for the batching to happen.
    """
    handler = (
        logging.StreamHandler(stream or sys.stderr) if flush_interval_s <= 0 else _TimedFlush(stream, flush_interval_s)
    )
    handler.setFormatter(JsonFormatter())
    return handler


def buffered_stderr(size: int = 1 << 16) -> IO[str]:
    """Standard error as a block-buffered text stream (the process's own ``sys.stderr`` may be
    unbuffered, as with PYTHONUNBUFFERED=1); it shares the file descriptor and never closes it."""
    raw = open(sys.stderr.fileno(), "wb", buffering=size, closefd=False)  # noqa: SIM115  # lives with the process
    return io.TextIOWrapper(raw, encoding="utf-8", line_buffering=False, write_through=False)


class _TimedFlush(logging.StreamHandler):  # type: ignore[type-arg]
    """Flushes when a record comes ``interval_s`` after the last flush, and from a timer thread, so the
    last lines before a quiet spell are out within ``interval_s`` too.

    The timer sleeps until a record is written: ticking every ``interval_s`` whatever happened cost an idle
    server 0.2 % of a core, and a busy one a preemption of the inference thread 20 times a second."""

    def __init__(self, stream: IO[str] | None, interval_s: float) -> None:
        super().__init__(stream or buffered_stderr())
        self._interval_ns = int(interval_s * 1e9)
        self._flushed_ns = time.monotonic_ns()
        self._stopped = threading.Event()
        self._written = threading.Event()  # a record since the timer's last flush
        threading.Thread(target=self._tick, args=(interval_s,), name="log-flush", daemon=True).start()

    def _tick(self, interval_s: float) -> None:
        while True:
            self._written.wait()
            if self._stopped.wait(interval_s):
                return  # close() flushes
            self._written.clear()  # before the flush: a record written during it sets it again
            super().flush()

    def flush(self) -> None:  # called by emit after every record: only now and then
        now = time.monotonic_ns()
        if now - self._flushed_ns >= self._interval_ns:
            self._flushed_ns = now
            super().flush()

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if not self._written.is_set():
            self._written.set()
        if record.levelno >= logging.WARNING:
            self._flushed_ns = 0
            self.flush()

    def close(self) -> None:
        self._stopped.set()
        self._written.set()  # the timer may be waiting for a record: let it see the stop
        self._flushed_ns = 0
        self.flush()
        super().close()


DIGEST_ALGORITHM = "xxh3-128"


def input_digest(inputs: Iterable[Any]) -> str:
    """``"xxh3-128:<32 hex>"``: XXH3-128 (seed 0) of the request's input bytes, input after input in
    request order. Not cryptographic: it identifies an input (lineage, duplicates), it does not
    authenticate one; a 128-bit digest makes accidental collisions negligible. The same in every
    process and on every machine (xxhash's canonical big-endian hex; nothing depends on PYTHONHASHSEED).

    The bytes digested: numeric arrays contribute their C-order little-endian bytes, which is what
    ``raw_input_contents`` carries; BYTES tensors (object arrays) their V2 raw encoding (4-byte
    little-endian length, then the bytes, per element); ``bytes`` are digested as given.
    """
    digest = xxhash.xxh3_128()
    for item in inputs:
        if isinstance(item, bytes | bytearray | memoryview):
            digest.update(item)
            continue
        array = np.asarray(item)
        if array.dtype == np.object_:
            for element in array.ravel():
                data = element if isinstance(element, bytes) else str(element).encode()
                digest.update(len(data).to_bytes(4, "little"))
                digest.update(data)
            continue
        little = array.dtype.newbyteorder("<")
        digest.update(np.ascontiguousarray(array, dtype=little).tobytes())
    return f"{DIGEST_ALGORITHM}:{digest.hexdigest()}"


def raw_digest(buffers: Sequence[bytes]) -> str:
    """``input_digest`` of ``raw_input_contents`` (the same bytes, without the per-item type checks)."""
    if len(buffers) == 1:
        return f"{DIGEST_ALGORITHM}:{xxhash.xxh3_128_hexdigest(buffers[0])}"
    digest = xxhash.xxh3_128()
    for buffer in buffers:
        digest.update(buffer)
    return f"{DIGEST_ALGORITHM}:{digest.hexdigest()}"


# A request record as the request thread leaves it: plain tuple, the cheapest thing to build.
# (epoch seconds, request id, model, version, input digest, runtime, rows, seconds taken, status,
#  trace id or None, invocation metadata to read the caller's trace id from or None,
#  logits or None, the version's monitors or None)
Record = tuple[float, str, str, str, str | None, str | None, int, float, str, str | None, Any, Any, Any]

# One request of a ``LaneBatch``, as the native front end hands it over: (request id or "", input digest or
# None, rows, perf_counter seconds when it arrived, the caller's traceparent or None).
LaneRequest = tuple[str, str | None, int, float, str | None]


class LaneBatch:
    """The requests of one native-lane batch that one version answered alike, recorded in one call
    (``RequestLogger.record_batch``): the lane thread then does nothing per request for the records. The
    telemetry thread expands it into one line per request, with one confidence computation for the
    batch's logits and the ids of requests that came without one made there.

    Args:
        when: Epoch seconds of the answer (every line of the batch carries it).
        model, version: The version that answered.
        runtime: The runtime level that ran the batch; None when it was refused.
        status: The batch's status name ("OK", or the error's code name).
        requests: The requests, in the order of ``logits``' rows.
        logits: The first output for exactly these requests' rows, in order; None when refused.
        monitors: The version's ``VersionMonitors`` (the abnormal flag) or None.
        late: Position in ``requests`` -> the status its caller saw instead (it stopped waiting), or None.
        answered: perf_counter seconds of the answer (each request's time taken is from its arrival).
    """

    __slots__ = ("answered", "late", "logits", "model", "monitors", "requests", "runtime", "status", "version", "when")

    def __init__(
        self,
        when: float,
        model: str,
        version: str,
        runtime: str | None,
        status: str,
        requests: Sequence[LaneRequest],
        logits: Any,
        monitors: Any,
        late: Mapping[int, str] | None,
        answered: float,
    ) -> None:
        self.when, self.model, self.version, self.runtime, self.status = when, model, version, runtime, status
        self.requests, self.logits, self.monitors, self.late, self.answered = requests, logits, monitors, late, answered


class LineSink:
    """Where request records go: whole JSON lines written to a file descriptor.

    Several server processes may share one stderr pipe or one file, so no write may carry part of a
    line: each ``write()`` is whole lines. To a pipe (or socket) each is at most ``PIPE_BUF`` (4096)
    bytes, the size up to which POSIX makes a pipe write atomic, so lines of different processes never
    interleave mid-line; a longer line goes alone and may then interleave (request lines are a few
    hundred bytes: ids and names are cut to ``max_echo_chars``). To a regular file opened ``O_APPEND``
    every write lands at the end as one piece, so a tick's lines go in one write.

    Args:
        fd: The descriptor (2: standard error).
        close: Close ``fd`` with the sink (a file this sink opened).
    """

    def __init__(self, fd: int, *, close: bool = False) -> None:
        self.fd = fd
        self._close = close
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0
        self.limit = PIPE_BUF if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else 1 << 20

    @classmethod
    def open(cls, path: Path | str) -> LineSink:
        """A file, created if missing, opened for appending (shared safely by several processes)."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return cls(fd, close=True)

    def write_lines(self, lines: Sequence[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) in as few writes as the limit allows."""
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if chunk and size + len(line) > self.limit:
                self._write(b"".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write(b"".join(chunk))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a short write happens only to a full non-pipe or on a signal: finish it
            view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        if self._close:
            os.close(self.fd)
            self._close = False


class RequestLogger:
    """The record of every request (by default), written as JSON lines in batches.

    The request thread only appends a tuple (``record``); the telemetry thread turns everything
    recorded since its last tick into lines (``drain``: the output confidences vectorised, one
    ``orjson.dumps`` per line) and hands them to the sink in a few writes. The lines keep the shape of
    the server's other JSON log lines (``ENVELOPE`` then ``REQUEST_FIELDS``, ``logger`` =
    ``serving.requests``), so log shippers and ``sluicegate lineage`` read them as before.

    Sampling is decided by a hash of the request id, so a request is recorded whole or not at all and
    every replica decides the same for it; an answer other than "OK" is always recorded. Give every
    request an id (the server assigns one when the client sent none): one empty id would be sampled for
    everyone at once.

    At most ``max_pending`` records wait for a tick; beyond it new ones are dropped and counted
    (``on_drop``), so a stalled sink never blocks an answer or grows memory.

    Args:
        sample_rate: Fraction of successful requests recorded, 0..1.
        max_echo_chars: Longest request id, model name or version written; longer ones are cut
            (``serving.errors.clip``): the caller chooses them, and five 4 MiB names were a 21 MB log.
        sink: Where lines go; default standard error.
        max_pending: Most records waiting for the telemetry thread.
        on_drop: Called with the number of records dropped (the request thread; keep it cheap).
        gpu_utilization: Read once per drain for the ``gpu_utilization`` field.
    """

    def __init__(
        self,
        sample_rate: float,
        *,
        max_echo_chars: int = ECHO_CHARS,
        sink: LineSink | None = None,
        max_pending: int = 10_000,
        on_drop: Callable[[int], None] | None = None,
        gpu_utilization: Callable[[], float | None] | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"log sample_rate must be between 0 and 1, got {sample_rate}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.sample_rate = sample_rate
        self.max_echo_chars = max_echo_chars
        self._bound = int(sample_rate * 2**64)  # sampled when the id's 64-bit hash is below it
        self._every = self._bound >= 2**64
        self.sink = sink or LineSink(2)
        self.max_pending = max_pending
        self.on_drop = on_drop
        self.gpu_utilization = gpu_utilization
        self.on_queued: Callable[[], None] | None = None
        # Records and lane batches; ``_queued`` counts the requests in them (under ``_count_lock``: the
        # bound is in requests, and a lane batch holds several).
        self._pending: deque[Record | LaneBatch] = deque()
        self._queued = 0
        self._count_lock = threading.Lock()
        self.dropped = 0
        self._stamps = IsoStamps()  # drain() runs on the telemetry thread only
        self._new_id = _request_ids()  # likewise

    def configure(
        self,
        *,
        sink: LineSink | None = None,
        max_pending: int | None = None,
        on_drop: Callable[[int], None] | None = None,
        gpu_utilization: Callable[[], float | None] | None = None,
        on_queued: Callable[[], None] | None = None,
    ) -> None:
        """Set what the server knows only once its telemetry exists (before the first request).
        ``on_queued``: called after each record or lane batch is queued (wakes the telemetry thread)."""
        if sink is not None:
            self.sink = sink
        if max_pending is not None:
            self.max_pending = max_pending
        self.on_drop = on_drop if on_drop is not None else self.on_drop
        self.gpu_utilization = gpu_utilization if gpu_utilization is not None else self.gpu_utilization
        self.on_queued = on_queued if on_queued is not None else self.on_queued

    def sampled(self, request_id: str) -> bool:
        """Whether a successful request with this id is recorded (check before computing its digest)."""
        if self._every:
            return True  # everything: no hash to compute
        head = hashlib.sha256(request_id.encode()).digest()[:8]
        return int.from_bytes(head, "big") < self._bound

    def wanted(self, request_id: str, status: str) -> bool:
        return status != "OK" or self.sampled(request_id)

    def record(self, record: Record) -> bool:
        """Queue one request's record (request thread); False when it was dropped (and counted)."""
        return self._queue(record, 1)

    def record_batch(self, batch: LaneBatch) -> bool:
        """Queue a lane batch's requests (lane thread), sampled when they are written; False when the
        queue had no room for all of them, which are then dropped (and counted)."""
        return self._queue(batch, len(batch.requests))

    def _queue(self, entry: Record | LaneBatch, count: int) -> bool:
        with self._count_lock:
            room = self._queued + count <= self.max_pending
            if room:
                self._queued += count
            else:
                self.dropped += count
        if room:
            self._pending.append(entry)
            if self.on_queued is not None:
                self.on_queued()
        elif self.on_drop is not None:
            self.on_drop(count)
        return room

    def log(
        self,
        *,
        request_id: str,
        model_name: str,
        model_version: str,
        input_digest: str | None,
        runtime: str | None,
        batch_size: int,
        inference_time_ms: float,
        output_confidence: float | None,
        abnormal_flag: bool,
        gpu_utilization: float | None,
        status: str,
        trace_id: str | None,
        timestamp: float | None = None,
    ) -> bool:
        """Record one request from its fields (tests, tools); the server calls ``record``. Written at the
        next ``drain``. Returns whether it was recorded (sampled or failed, and not dropped)."""
        if not self.wanted(request_id, status):
            return False
        fixed = _Fixed(output_confidence, abnormal_flag, gpu_utilization)
        return self.record(
            (
                time.time() if timestamp is None else timestamp,
                request_id,
                model_name,
                model_version,
                input_digest,
                runtime,
                batch_size,
                inference_time_ms / 1e3,
                status,
                trace_id,
                None,
                fixed,
                None,
            )
        )

    def drain(self) -> int:
        """Write every record queued so far (telemetry thread); returns how many lines were written."""
        pending = self._pending
        count = len(pending)
        if not count:
            return 0
        entries = [pending.popleft() for _ in range(count)]
        batches = [entry for entry in entries if isinstance(entry, LaneBatch)]
        singles = [entry for entry in entries if not isinstance(entry, LaneBatch)]
        with self._count_lock:
            self._queued -= len(singles) + sum(len(batch.requests) for batch in batches)
        gpu = _finite(self.gpu_utilization()) if self.gpu_utilization is not None else None
        abnormal: dict[int, bool] = {}  # per version's monitors, read once a tick

        def flagged(runtime: str | None, monitors: Any) -> bool:
            if runtime == "rules":
                return True
            if monitors is None:
                return False
            key = id(monitors)
            if key not in abnormal:
                abnormal[key] = bool(monitors.abnormal)
            return abnormal[key]

        lines: list[bytes] = []
        single_confidences = iter(_confidences([r[11] for r in singles]))
        batch_confidences = iter(_lane_confidences(batches))
        for entry in entries:
            if isinstance(entry, LaneBatch):
                self._batch_lines(entry, next(batch_confidences), gpu, flagged, lines)
            else:
                self._record_line(entry, next(single_confidences), gpu, flagged, lines)
        if lines:
            self.sink.write_lines(lines)
        return len(lines)

    def _record_line(
        self,
        record: Record,
        confidence: float | None,
        gpu: float | None,
        flagged: Callable[[str | None, Any], bool],
        lines: list[bytes],
    ) -> None:
        when, request_id, model, version, digest, runtime, rows, seconds, status = record[:9]
        trace, metadata, logits, monitors = record[9:]
        if trace is None and metadata:
            trace = _trace_id(metadata)
        if isinstance(logits, _Fixed):
            flag, gpu = logits.abnormal, _finite(logits.gpu)
        else:
            flag = flagged(runtime, monitors)
        echo = self.max_echo_chars
        fields = {
            "timestamp": self._stamps(when),
            "level": "INFO" if status == "OK" else "WARNING",
            "logger": REQUEST_LOGGER,
            "message": "inference",
            "request_id": clip(request_id, echo),
            "model_name": clip(model, echo),
            "model_version": clip(version, echo),
            "input_digest": digest,
            "runtime": runtime,
            "batch_size": int(rows),
            "inference_time_ms": _finite(round(seconds * 1e3, 3)),
            "output_confidence": confidence,
            "abnormal_flag": flag,
            "gpu_utilization": gpu,
            "status": status,
            "trace_id": trace,
        }
        lines.append(_dumps(fields))

    def _batch_lines(
        self,
        batch: LaneBatch,
        confidences: list[float | None],
        gpu: float | None,
        flagged: Callable[[str | None, Any], bool],
        lines: list[bytes],
    ) -> None:
        """The lines of a lane batch's sampled requests: what they share is made once, in one dict copied
        per request (the same fields, in the same order, as ``_record_line``'s)."""
        echo, late, every = self.max_echo_chars, batch.late, self._every
        new_id = self._new_id
        shared = {
            "timestamp": self._stamps(batch.when),
            "level": "INFO" if batch.status == "OK" else "WARNING",
            "logger": REQUEST_LOGGER,
            "message": "inference",
            "request_id": "",
            "model_name": clip(batch.model, echo),
            "model_version": clip(batch.version, echo),
            "input_digest": None,
            "runtime": batch.runtime if batch.status == "OK" else None,
            "batch_size": 0,
            "inference_time_ms": None,
            "output_confidence": None,
            "abnormal_flag": flagged(batch.runtime, batch.monitors),
            "gpu_utilization": gpu,
            "status": batch.status,
            "trace_id": None,
        }
        answered = batch.answered
        for index, (request_id, digest, rows, received, traceparent) in enumerate(batch.requests):
            status = late.get(index, batch.status) if late else batch.status
            request_id = request_id or new_id()  # an empty id must not share one sampling decision
            if status == "OK" and not every and not self.sampled(request_id):
                continue
            fields = shared.copy()
            fields["request_id"] = clip(request_id, echo)
            fields["input_digest"] = digest
            fields["batch_size"] = rows
            fields["inference_time_ms"] = _finite(round((answered - received) * 1e3, 3))
            fields["output_confidence"] = confidences[index]
            if traceparent:
                fields["trace_id"] = _trace_id((("traceparent", traceparent),))
            if status != batch.status:  # its caller stopped waiting: counted as what it saw
                fields.update(level="WARNING", runtime=None, status=status)
            lines.append(_dumps(fields))

    def close(self) -> None:
        self.drain()
        self.sink.close()


class _Fixed:
    """The fields ``RequestLogger.log`` was given outright, carried in a record's logits slot."""

    __slots__ = ("abnormal", "confidence", "gpu")

    def __init__(self, confidence: float | None, abnormal: bool, gpu: float | None) -> None:
        self.confidence, self.abnormal, self.gpu = confidence, bool(abnormal), gpu


def _confidences(logits: list[Any]) -> list[float | None]:
    """Each record's ``output_confidence`` (its least sure row's top softmax probability), in a few numpy
    calls for the tick: the records whose logits share a class count are stacked and done at once."""
    out: list[float | None] = [None] * len(logits)
    groups: dict[int, list[int]] = {}
    for index, value in enumerate(logits):
        if isinstance(value, _Fixed):
            out[index] = _finite(value.confidence)
        elif isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[0] and value.shape[1]:
            groups.setdefault(value.shape[1], []).append(index)
    for members in groups.values():
        parts = [logits[i] for i in members]
        least = _least_confidences(parts, [[len(part)] for part in parts])
        for index, value in zip(members, least, strict=True):
            out[index] = value
    return out


def _lane_confidences(batches: Sequence[LaneBatch]) -> list[list[float | None]]:
    """Each lane batch's requests' confidences: the batches whose logits share a class count are stacked
    and done at once, whatever the number of requests in them."""
    out: list[list[float | None]] = [[None] * len(batch.requests) for batch in batches]
    groups: dict[int, list[int]] = {}
    for index, batch in enumerate(batches):
        value = batch.logits
        if (
            isinstance(value, np.ndarray)
            and value.ndim == 2
            and value.shape[1]
            and value.shape[0] == sum(request[2] for request in batch.requests) > 0
        ):
            groups.setdefault(value.shape[1], []).append(index)
    for members in groups.values():
        parts = [batches[i].logits for i in members]
        least = iter(_least_confidences(parts, [[request[2] for request in batches[i].requests] for i in members]))
        for index in members:
            out[index] = [next(least) for _ in batches[index].requests]
    return out


def _least_confidences(parts: Sequence[Any], rows: Sequence[Sequence[int]]) -> list[float | None]:
    """The least top-class softmax probability of each request: ``parts`` are 2-D logits of one class
    count, ``rows[i]`` the rows of each request in ``parts[i]`` (in order, summing to its length)."""
    stacked = np.concatenate(parts, dtype=np.float64)  # one conversion, not one per part
    top = stacked.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        best = 1.0 / np.exp(stacked - top).sum(axis=1)  # the top class's softmax probability per row
    counts = [count for part in rows for count in part]
    starts = np.cumsum([0, *counts[:-1]])
    least = np.minimum.reduceat(best, starts)
    return [value if math.isfinite(value) else None for value in least.tolist()]


def _request_ids() -> Callable[[], str]:
    """Ids for requests that came without one, 32 hex digits each, from one ``os.urandom`` call per 256
    (a ``secrets.token_hex`` per request was a system call per request)."""
    buffer: list[str] = []

    def new_id() -> str:
        if not buffer:
            data = os.urandom(16 * 256).hex()
            buffer.extend(data[i : i + 32] for i in range(0, len(data), 32))
        return buffer.pop()

    return new_id


class IsoStamps:
    """``datetime.fromtimestamp(when, UTC).isoformat(timespec="microseconds")``, with the date and time up
    to the second formatted once per second: a record's stamp costs 0.8 us instead of 3.2 us, and the
    telemetry thread stamps every request. Rounds the microseconds as datetime does (half to even, carried
    into the second). One instance per thread: it keeps the last second's text."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second: int | None = None
        self._prefix = ""

    def __call__(self, when: float) -> str:
        fraction, whole = math.modf(when)
        micros = round(fraction * 1e6)
        if micros >= 1_000_000:
            whole, micros = whole + 1, micros - 1_000_000
        elif micros < 0:
            whole, micros = whole - 1, micros + 1_000_000
        second = int(whole)
        if second != self._second:
            self._prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = second
        return f"{self._prefix}.{micros:06d}+00:00"


def _trace_id(metadata: Any) -> str | None:
    """The trace id of a caller's ``traceparent`` among ``metadata`` (key, value) pairs, or None."""
    if not any(key == "traceparent" for key, _ in metadata):
        return None
    from serving.observability.tracing import incoming_trace_id

    return incoming_trace_id(metadata)


def _dumps(fields: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # a lone surrogate in a caller's text: the standard encoder escapes it
        return (json.dumps(fields, separators=(",", ":"), default=str) + "\n").encode()


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
