"""JSON request logs through a real logging handler: one valid JSON line per request with exactly the
agreed fields, deterministic sampling by request id, errors always logged."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from serving.observability.logs import (
    ENVELOPE,
    REQUEST_FIELDS,
    JsonFormatter,
    RequestLogger,
    input_hash,
    json_handler,
    log_context,
)


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A private logger writing JSON lines into a buffer (the root logger is left alone)."""
    stream = io.StringIO()
    logger = logging.getLogger(f"test.requests.{id(stream)}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = json_handler(stream)
    logger.addHandler(handler)
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def fields(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "request_id": "req-1",
        "model_name": "pcb",
        "model_version": "2",
        "input_hash": hashlib.sha256(b"pixels").hexdigest(),
        "runtime": "onnxruntime",
        "batch_size": 4,
        "inference_time_ms": 1.23456789,
        "output_confidence": 0.97,
        "abnormal_flag": False,
        "gpu_utilization": None,
        "status": "OK",
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
    }
    return {**values, **overrides}


def test_a_request_line_is_json_with_exactly_the_agreed_fields(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    with log_context(request_id="req-1", tenant="must-not-appear"):
        assert RequestLogger(1.0, logger=logger).log(**fields())
    (line,) = lines(stream)
    assert set(line) == set(ENVELOPE) | set(REQUEST_FIELDS)
    assert line["message"] == "inference" and line["level"] == "INFO" and line["logger"] == logger.name
    assert line["inference_time_ms"] == 1.235  # microsecond precision
    assert {key: line[key] for key in REQUEST_FIELDS if key != "inference_time_ms"} == {
        key: value for key, value in fields().items() if key != "inference_time_ms"
    }
    assert line["timestamp"].endswith("+00:00")


def test_non_finite_numbers_become_null_and_the_line_stays_valid(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    RequestLogger(1.0, logger=logger).log(**fields(output_confidence=math.nan, gpu_utilization=math.inf))
    text = stream.getvalue()
    assert "NaN" not in text and "Infinity" not in text
    (line,) = lines(stream)
    assert line["output_confidence"] is None and line["gpu_utilization"] is None


def test_sampling_rate_is_respected_and_deterministic_per_request() -> None:
    sampler = RequestLogger(0.1)
    ids = [f"{i:08x}-request" for i in range(20_000)]
    chosen = [sampler.sampled(request_id) for request_id in ids]
    rate = sum(chosen) / len(ids)
    sigma = math.sqrt(0.1 * 0.9 / len(ids))
    assert abs(rate - 0.1) < 4 * sigma
    # Same decision every time and in every process/replica (a hash, not a random draw).
    assert [RequestLogger(0.1).sampled(request_id) for request_id in ids] == chosen
    # A lower rate samples a subset of a higher one: turning the rate down never logs new requests.
    lower = RequestLogger(0.05)
    assert all(not lower.sampled(request_id) or was for request_id, was in zip(ids, chosen, strict=True))


def test_errors_are_always_logged_and_successes_follow_the_rate(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    never = RequestLogger(0.0, logger=logger)
    for i in range(50):
        assert not never.log(**fields(request_id=f"ok-{i}"))
    assert never.log(**fields(request_id="bad", status="INVALID_ARGUMENT", output_confidence=None))
    (line,) = lines(stream)
    assert line["status"] == "INVALID_ARGUMENT" and line["level"] == "WARNING"
    always = RequestLogger(1.0, logger=logger)
    assert all(always.log(**fields(request_id=f"ok-{i}")) for i in range(50))
    assert len(lines(stream)) == 51


def test_nothing_but_the_request_lines_is_logged(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    sampler = RequestLogger(0.3, logger=logger)
    ids = [f"id-{i}" for i in range(300)]
    written = [request_id for request_id in ids if sampler.log(**fields(request_id=request_id))]
    logged = lines(stream)
    assert [line["request_id"] for line in logged] == written
    assert all(set(line) == set(ENVELOPE) | set(REQUEST_FIELDS) for line in logged)


def test_other_records_carry_the_bound_context_and_tracebacks(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    with log_context(request_id="req-9", model="pcb"), log_context(version="3"):
        logger.warning("slow batch: %d ms", 40)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    first, second = lines(stream)
    assert first == {**first, "message": "slow batch: 40 ms", "request_id": "req-9", "model": "pcb", "version": "3"}
    assert "request_id" not in second  # the context ended with its block
    assert "RuntimeError: boom" in second["exception"]


def test_formatter_is_a_logging_formatter() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    assert json.loads(JsonFormatter().format(record))["message"] == "hello world"


def test_input_hash_is_the_sha256_of_the_raw_input_bytes() -> None:
    image = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    mask = np.array([[1, 0]], dtype=np.uint8)
    assert input_hash([image, mask]) == hashlib.sha256(image.tobytes() + mask.tobytes()).hexdigest()
    assert input_hash([image.astype(">f4")]) == input_hash([image])  # little-endian, as on the wire
    assert input_hash([np.asfortranarray(image)]) == input_hash([image])  # C order
    assert input_hash([image.tobytes()]) == input_hash([image])
    words = np.array([b"ab", b"c"], dtype=object)  # BYTES: 4-byte little-endian length, then the bytes
    assert input_hash([words]) == hashlib.sha256(b"\x02\x00\x00\x00ab\x01\x00\x00\x00c").hexdigest()


def test_bad_sample_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        RequestLogger(1.5)


def test_a_timed_flush_handler_batches_writes_but_never_holds_a_line_long() -> None:
    """The server's handler: lines reach the stream at most ``interval`` late, warnings at once."""
    buffer = io.StringIO()
    written: list[str] = []

    class Spy(io.TextIOBase):
        def write(self, text: str) -> int:
            buffer.write(text)
            return len(text)

        def flush(self) -> None:
            written.append(buffer.getvalue())

    handler = json_handler(Spy(), flush_interval_s=0.2)  # type: ignore[arg-type]
    logger = logging.getLogger("test.timed-flush")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    try:
        flushes = len(written)
        for index in range(50):
            logger.info("line %d", index)
        assert len(written) - flushes <= 1  # 50 lines, at most one flush
        deadline = time.monotonic() + 5
        while not (written and '"line 49"' in written[-1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert written and '"line 49"' in written[-1]  # the timer pushed the tail out
        logger.warning("careful")
        assert '"careful"' in written[-1]  # warnings are never held back
    finally:
        logger.removeHandler(handler)
        handler.close()
