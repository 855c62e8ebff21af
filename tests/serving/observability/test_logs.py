"""JSON request logs through a real logging handler: one valid JSON line per request with exactly the
agreed fields, deterministic sampling by request id, errors always logged."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from serving.observability.logs import (
    ENVELOPE,
    REQUEST_FIELDS,
    REQUEST_LOGGER,
    IsoStamps,
    JsonFormatter,
    LaneBatch,
    LineSink,
    RequestLogger,
    input_digest,
    json_handler,
    log_context,
    raw_digest,
)

ROOT = Path(__file__).resolve().parents[3]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# XXH3-128 (seed 0) of bytes(range(256)) * 64, canonical hex; a fixed value, so a change of algorithm,
# seed or byte definition fails here rather than in a lineage search months later.
KNOWN_DIGEST = "xxh3-128:5266a2381f3587fec96b04ebefa8f6dc"


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


@pytest.fixture
def sink_path(tmp_path: Path) -> Path:
    return tmp_path / "requests.jsonl"


def written(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def fields(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "request_id": "req-1",
        "model_name": "pcb",
        "model_version": "2",
        "input_digest": input_digest([b"pixels"]),
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


def test_a_request_line_is_json_with_exactly_the_agreed_fields(sink_path: Path) -> None:
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path))
    with log_context(request_id="req-1", tenant="must-not-appear"):
        assert requests.log(**fields())
    assert not sink_path.read_text()  # written by the telemetry thread's drain, not by the caller
    assert requests.drain() == 1
    (line,) = written(sink_path)
    assert list(line) == [*ENVELOPE, *REQUEST_FIELDS]
    assert line["message"] == "inference" and line["level"] == "INFO" and line["logger"] == REQUEST_LOGGER
    assert line["inference_time_ms"] == 1.235  # microsecond precision
    assert {key: line[key] for key in REQUEST_FIELDS if key != "inference_time_ms"} == {
        key: value for key, value in fields().items() if key != "inference_time_ms"
    }
    assert line["timestamp"].endswith("+00:00")


def test_non_finite_numbers_become_null_and_the_line_stays_valid(sink_path: Path) -> None:
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path))
    requests.log(**fields(output_confidence=math.nan, gpu_utilization=math.inf))
    requests.drain()
    text = sink_path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    (line,) = written(sink_path)
    assert line["output_confidence"] is None and line["gpu_utilization"] is None


def test_server_records_get_their_confidence_from_the_logits_per_tick(sink_path: Path) -> None:
    """The request thread leaves logits; the drain softmaxes every record of the tick at once."""
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path), gpu_utilization=lambda: 0.25)
    sure = np.array([[0.0, 0.0, 10.0, 0.0]], dtype=np.float32)
    split = np.array([[0.0, 0.0], [5.0, 0.0]], dtype=np.float32)  # the least sure row counts: 0.5
    for request_id, logits in (("a", sure), ("b", split), ("c", None)):
        record = (
            1.7e9,
            request_id,
            "m",
            "1",
            "xxh3-128:" + "0" * 32,
            "onnxruntime",
            1 if logits is None else len(logits),
            0.002,
        )
        assert requests.record((*record, "OK", None, (("traceparent", TRACEPARENT),), logits, None))
    requests.drain()
    by_id = {line["request_id"]: line for line in written(sink_path)}
    softmax_top = math.exp(10) / (math.exp(10) + 3)
    assert by_id["a"]["output_confidence"] == pytest.approx(softmax_top)
    assert by_id["b"]["output_confidence"] == pytest.approx(0.5)
    assert by_id["c"]["output_confidence"] is None
    assert {line["trace_id"] for line in by_id.values()} == {TRACEPARENT.split("-")[1]}  # from the metadata
    assert {line["gpu_utilization"] for line in by_id.values()} == {0.25}
    assert by_id["a"]["timestamp"] == "2023-11-14T22:13:20.000000+00:00"


def _lane_batch(requests: list[tuple[str, str | None, int, float, str | None]], logits: Any, **kw: Any) -> LaneBatch:
    values: dict[str, Any] = {
        "when": 1.7e9,
        "model": "m",
        "version": "1",
        "runtime": "onnxruntime",
        "status": "OK",
        "monitors": None,
        "late": None,
        "answered": 10.0,
    }
    values.update(kw)
    return LaneBatch(requests=requests, logits=logits, **values)


def test_a_lane_batch_writes_the_same_lines_as_one_record_per_request(sink_path: Path) -> None:
    """A native lane records a batch in one call; each request's line is the one a record would give."""
    digest = "xxh3-128:" + "1" * 32
    logits = np.array([[0.0, 0.0, 10.0, 0.0], [0.0, 5.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    lane = RequestLogger(1.0, sink=LineSink.open(sink_path), gpu_utilization=lambda: 0.5)
    requests = [("a", digest, 1, 9.998, TRACEPARENT), ("b", digest, 2, 9.9995, None)]
    assert lane.record_batch(_lane_batch(requests, logits))
    assert lane.drain() == 2
    batch_lines = written(sink_path)
    sink_path.unlink()
    single = RequestLogger(1.0, sink=LineSink.open(sink_path), gpu_utilization=lambda: 0.5)
    for (request_id, _, rows, received, traceparent), part in zip(requests, (logits[:1], logits[1:]), strict=True):
        metadata = (("traceparent", traceparent),) if traceparent else None
        record = (1.7e9, request_id, "m", "1", digest, "onnxruntime", rows, 10.0 - received, "OK", None, metadata)
        assert single.record((*record, part, None))
    single.drain()
    assert batch_lines == written(sink_path)
    assert [list(line) for line in batch_lines] == [[*ENVELOPE, *REQUEST_FIELDS]] * 2
    assert batch_lines[0]["inference_time_ms"] == 2.0 and batch_lines[0]["trace_id"] == TRACEPARENT.split("-")[1]
    assert batch_lines[1]["output_confidence"] == pytest.approx(1 / (1 + 3 * math.exp(-5)))  # its least sure row


def test_a_lane_batch_names_late_callers_makes_missing_ids_and_samples_per_request(sink_path: Path) -> None:
    logits = np.zeros((40, 2), dtype=np.float32)
    requests = [(f"id-{i}" if i % 2 else "", None, 1, 9.0, None) for i in range(40)]
    sampler = RequestLogger(0.5, sink=LineSink.open(sink_path))
    assert sampler.record_batch(_lane_batch(requests, logits, late={0: "DEADLINE_EXCEEDED", 3: "CANCELLED"}))
    sampler.close()
    logged = {line["request_id"]: line for line in written(sink_path)}
    late = [line for line in logged.values() if line["status"] != "OK"]
    # The late callers are always written (not OK), as what they saw, and nothing ran for them.
    assert sorted(line["status"] for line in late) == ["CANCELLED", "DEADLINE_EXCEEDED"]
    assert all(line["level"] == "WARNING" and line["runtime"] is None for line in late)
    assert logged["id-3"]["status"] == "CANCELLED"
    kept = [f"id-{i}" for i in range(1, 40, 2) if i == 3 or RequestLogger(0.5).sampled(f"id-{i}")]
    assert sorted(i for i in logged if i.startswith("id-")) == sorted(kept)
    made = [i for i in logged if not i.startswith("id-")]  # ids made for the requests that sent none
    assert made and len(set(made)) == len(made) and all(len(i) == 32 and int(i, 16) >= 0 for i in made)
    assert all(line["output_confidence"] == 0.5 for line in logged.values())


def test_a_lane_batch_counts_against_the_bound_by_its_requests(sink_path: Path) -> None:
    counted: list[int] = []
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path), max_pending=5, on_drop=counted.append)
    three = [(f"r{i}", None, 1, 9.0, None) for i in range(3)]
    assert requests.record_batch(_lane_batch(three, np.zeros((3, 2))))
    assert not requests.record_batch(_lane_batch(three, np.zeros((3, 2))))  # 6 > 5: the whole batch
    assert requests.log(**fields(request_id="single"))
    assert counted == [3] and requests.dropped == 3
    requests.drain()
    assert requests.record_batch(_lane_batch(three, np.zeros((3, 2))))  # room again once drained
    requests.close()
    assert [line["request_id"] for line in written(sink_path)] == ["r0", "r1", "r2", "single", "r0", "r1", "r2"]


def test_a_refused_lane_batch_is_written_without_outputs(sink_path: Path) -> None:
    requests = RequestLogger(0.0, sink=LineSink.open(sink_path))
    refused = _lane_batch([("x", None, 2, 9.5, None)], None, runtime=None, status="RESOURCE_EXHAUSTED")
    assert requests.record_batch(refused)
    requests.close()
    (line,) = written(sink_path)
    assert line["status"] == "RESOURCE_EXHAUSTED" and line["output_confidence"] is None and line["batch_size"] == 2


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


def test_errors_are_always_logged_and_successes_follow_the_rate(sink_path: Path) -> None:
    never = RequestLogger(0.0, sink=LineSink.open(sink_path))
    for i in range(50):
        assert not never.log(**fields(request_id=f"ok-{i}"))
    assert never.log(**fields(request_id="bad", status="INVALID_ARGUMENT", output_confidence=None))
    never.close()
    (line,) = written(sink_path)
    assert line["status"] == "INVALID_ARGUMENT" and line["level"] == "WARNING"
    always = RequestLogger(1.0, sink=LineSink.open(sink_path))
    assert all(always.log(**fields(request_id=f"ok-{i}")) for i in range(50))
    always.close()
    assert len(written(sink_path)) == 51


def test_nothing_but_the_sampled_request_lines_is_written(sink_path: Path) -> None:
    sampler = RequestLogger(0.3, sink=LineSink.open(sink_path))
    ids = [f"id-{i}" for i in range(300)]
    chosen = [request_id for request_id in ids if sampler.log(**fields(request_id=request_id))]
    sampler.close()
    logged = written(sink_path)
    assert [line["request_id"] for line in logged] == chosen and 0 < len(chosen) < 300
    assert all(list(line) == [*ENVELOPE, *REQUEST_FIELDS] for line in logged)


def test_beyond_the_bound_records_are_dropped_and_counted_never_queued(sink_path: Path) -> None:
    counted: list[int] = []
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path), max_pending=3, on_drop=counted.append)
    accepted = [requests.log(**fields(request_id=f"r{i}")) for i in range(5)]
    assert accepted == [True, True, True, False, False] and sum(counted) == 2 == requests.dropped
    requests.drain()
    assert requests.log(**fields(request_id="after"))  # room again once drained
    requests.close()
    assert [line["request_id"] for line in written(sink_path)] == ["r0", "r1", "r2", "after"]


def test_callers_text_is_cut_and_odd_characters_keep_the_line_valid(sink_path: Path) -> None:
    requests = RequestLogger(1.0, sink=LineSink.open(sink_path), max_echo_chars=16)
    requests.log(**fields(request_id="x" * 1000, model_name="a\nb\ud800c", model_version='"}{'))
    requests.close()
    (line,) = written(sink_path)
    assert len(line["request_id"]) < 40 and line["model_version"] == '"}{'
    assert line["model_name"].startswith("a\nb")


def test_lines_from_several_processes_sharing_one_pipe_never_interleave() -> None:
    """Each write is whole lines of at most PIPE_BUF bytes, which POSIX keeps atomic on a pipe: four
    processes writing thousands of lines into one pipe leave only whole lines."""
    read_end, write_end = os.pipe()
    assert LineSink(write_end).limit == 4096
    script = (
        "import sys; from serving.observability.logs import LineSink, RequestLogger\n"
        "requests = RequestLogger(1.0, sink=LineSink(int(sys.argv[1])), max_pending=10**6)\n"
        "for i in range(3000):\n"
        "    requests.log(request_id=f'{sys.argv[2]}-{i}-' + 'x' * 200, model_name='m', model_version='1',"
        " input_digest=None, runtime=None, batch_size=1, inference_time_ms=1.0, output_confidence=None,"
        " abnormal_flag=False, gpu_utilization=None, status='OK', trace_id=None)\n"
        "    if i % 500 == 499: requests.drain()\n"
        "requests.drain()\n"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(write_end), f"w{n}"], pass_fds=(write_end,), cwd=ROOT)
        for n in range(4)
    ]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    assert all(writer.wait(60) == 0 for writer in writers)
    seen = [json.loads(line)["request_id"].split("-")[:2] for line in data.splitlines()]
    assert sorted(seen) == sorted([f"w{n}", str(i)] for n in range(4) for i in range(3000))


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


def test_input_digest_is_the_xxh3_128_of_the_raw_input_bytes() -> None:
    image = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    mask = np.array([[1, 0]], dtype=np.uint8)
    expected = "xxh3-128:" + xxhash.xxh3_128_hexdigest(image.tobytes() + mask.tobytes())
    assert input_digest([image, mask]) == expected == raw_digest([image.tobytes(), mask.tobytes()])
    assert input_digest([image.astype(">f4")]) == input_digest([image])  # little-endian, as on the wire
    assert input_digest([np.asfortranarray(image)]) == input_digest([image])  # C order
    assert input_digest([image.tobytes()]) == input_digest([image]) == raw_digest([image.tobytes()])
    words = np.array([b"ab", b"c"], dtype=object)  # BYTES: 4-byte little-endian length, then the bytes
    assert input_digest([words]) == "xxh3-128:" + xxhash.xxh3_128_hexdigest(b"\x02\x00\x00\x00ab\x01\x00\x00\x00c")


def test_input_digest_is_the_same_in_every_process() -> None:
    """A known value, from the definition, computed in processes with different hash seeds."""
    code = "from serving.observability.logs import input_digest; print(input_digest([bytes(range(256)) * 64]))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "12345")
    }
    assert seen == {KNOWN_DIGEST} == {input_digest([bytes(range(256)) * 64])}


def test_bad_sample_rates_and_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        RequestLogger(1.5)
    with pytest.raises(ValueError, match="max_pending"):
        RequestLogger(1.0, max_pending=0)


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
        # Quiet: the timer sleeps until the next record instead of flushing every interval.
        time.sleep(0.5)  # its last flush of the warning, if any
        quiet = len(written)
        time.sleep(1.0)
        assert len(written) == quiet, "an idle handler's timer must not tick"
        logger.info("after the quiet spell")
        deadline = time.monotonic() + 5
        while '"after the quiet spell"' not in written[-1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert '"after the quiet spell"' in written[-1]
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_iso_stamps_equal_datetime_isoformat_including_rounding_edges() -> None:
    from datetime import UTC, datetime

    rng = np.random.default_rng(11)
    now = time.time()
    whens = [
        *(now + rng.uniform(0, 30, 20_000)).tolist(),  # many stamps per second, as the telemetry thread sees them
        *rng.uniform(-3e9, 4e9, 10_000).tolist(),  # before 1970 too
        *[second + edge for second in (0.0, -1.0, 1e9, now // 1) for edge in (0.9999995, 0.9999994999, 5e-7, -5e-7)],
        *[round(now) + k / 1e6 + 5e-7 for k in range(10_000)],  # half-microsecond ties
    ]
    stamps = IsoStamps()
    for when in whens:
        assert stamps(when) == datetime.fromtimestamp(when, UTC).isoformat(timespec="microseconds"), when
