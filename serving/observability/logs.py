"""Structured JSON logs: one JSON object per line, through the standard ``logging`` module.

``JsonFormatter`` formats every record of the server: a fixed envelope (timestamp, level, logger,
message) plus the request context bound with ``log_context`` (model, version, request id: contextvars,
so a warning logged deep in the data plane still names its request). ``RequestLogger`` writes the
per-request line, whose fields are exactly ``REQUEST_FIELDS``: never tensors, parameters or anything
else from the request body. Logging is configured by the entry point (``json_handler``), never here at
import.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Any

import numpy as np

REQUEST_LOGGER = "serving.requests"
REQUEST_FIELDS = (
    "request_id",
    "model_name",
    "model_version",
    "input_hash",
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
_RECORD_KEY = "sluicegate_request"  # LogRecord attribute carrying a request line's fields
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
    """One JSON object per record: the envelope, then the request fields or the bound context, then the
    traceback (``exception``) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, _RECORD_KEY, None)
        payload.update(fields if isinstance(fields, Mapping) else _context.get())
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
    last lines before a quiet spell are out within ``interval_s`` too."""

    def __init__(self, stream: IO[str] | None, interval_s: float) -> None:
        super().__init__(stream or buffered_stderr())
        self._interval_ns = int(interval_s * 1e9)
        self._flushed_ns = time.monotonic_ns()
        self._stopped = threading.Event()
        threading.Thread(target=self._tick, args=(interval_s,), name="log-flush", daemon=True).start()

    def _tick(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            super().flush()

    def flush(self) -> None:  # called by emit after every record: only now and then
        now = time.monotonic_ns()
        if now - self._flushed_ns >= self._interval_ns:
            self._flushed_ns = now
            super().flush()

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        if record.levelno >= logging.WARNING:
            self._flushed_ns = 0
            self.flush()

    def close(self) -> None:
        self._stopped.set()
        self._flushed_ns = 0
        self.flush()
        super().close()


def input_hash(inputs: Iterable[Any]) -> str:
    """sha256 hex of the request's input bytes, input after input in request order.

    Numeric arrays contribute their C-order little-endian bytes, which is what ``raw_input_contents``
    carries; BYTES tensors (object arrays) their V2 raw encoding (4-byte little-endian length, then the
    bytes, per element); ``bytes`` are hashed as given.
    """
    digest = hashlib.sha256()
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
    return digest.hexdigest()


class RequestLogger:
    """The per-request JSON line, sampled.

    Sampling is decided by a hash of the request id, so a request is logged whole or not at all and
    every replica decides the same for it; an answer other than "OK" is always logged. Give every request
    an id (the server should assign a uuid4 when the client sent none): one empty id would be sampled
    for everyone at once.

    Args:
        sample_rate: Fraction of successful requests logged, 0..1.
        logger: Where the lines go; default the ``serving.requests`` logger.
    """

    def __init__(self, sample_rate: float, *, logger: logging.Logger | None = None) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"log sample_rate must be between 0 and 1, got {sample_rate}")
        self.sample_rate = sample_rate
        self._bound = int(sample_rate * 2**64)  # sampled when the id's 64-bit hash is below it
        self._logger = logger or logging.getLogger(REQUEST_LOGGER)

    def sampled(self, request_id: str) -> bool:
        """Whether a successful request with this id is logged (check before computing its input hash)."""
        if self._bound >= 2**64:
            return True  # everything: no hash to compute
        head = hashlib.sha256(request_id.encode()).digest()[:8]
        return int.from_bytes(head, "big") < self._bound

    def wanted(self, request_id: str, status: str) -> bool:
        return status != "OK" or self.sampled(request_id)

    def log(
        self,
        *,
        request_id: str,
        model_name: str,
        model_version: str,
        input_hash: str | None,
        runtime: str | None,
        batch_size: int,
        inference_time_ms: float,
        output_confidence: float | None,
        abnormal_flag: bool,
        gpu_utilization: float | None,
        status: str,
        trace_id: str | None,
    ) -> bool:
        """Write the line if the request is sampled or failed; returns whether it was written.

        ``status`` is "OK" or the gRPC status code's name; ``inference_time_ms`` is rounded to the
        microsecond; non-finite floats are written as null.
        """
        if not self.wanted(request_id, status):
            return False
        fields = {
            "request_id": request_id,
            "model_name": model_name,
            "model_version": model_version,
            "input_hash": input_hash,
            "runtime": runtime,
            "batch_size": int(batch_size),
            "inference_time_ms": _finite(round(float(inference_time_ms), 3)),
            "output_confidence": _finite(output_confidence),
            "abnormal_flag": bool(abnormal_flag),
            "gpu_utilization": _finite(gpu_utilization),
            "status": status,
            "trace_id": trace_id,
        }
        level = logging.INFO if status == "OK" else logging.WARNING
        logger = self._logger
        if logger.isEnabledFor(level):
            # makeRecord + handle rather than logger.log: the same handlers, filters and levels, without
            # findCaller's walk up the stack (a source line says nothing about a request line).
            extra = {_RECORD_KEY: MappingProxyType(fields)}
            logger.handle(logger.makeRecord(logger.name, level, "", 0, "inference", (), None, extra=extra))
        return True


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
