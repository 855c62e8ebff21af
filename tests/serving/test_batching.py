"""DynamicBatcher with real threads and a real numpy model: answers per caller, caps, back-pressure, drain."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from serving.batching import DynamicBatcher, signature
from serving.errors import InvalidInput, ModelNotReady, Overloaded, RuntimeFailure

Array = npt.NDArray[Any]


def triple(inputs: dict[str, Array]) -> dict[str, Array]:
    """The model: y = 3x, and the row id (column 0 of x) passed through so each caller can check its rows."""
    x = inputs["x"]
    return {"y": x * 3, "id": x[:, 0].copy()}


def rows_for(caller: int, seq: int, n: int, width: int = 4, dtype: type = np.float64) -> Array:
    """n rows whose column 0 is a globally unique row id and whose other columns depend on it."""
    ids: Array = np.array([caller * 100_000 + seq * 10 + i for i in range(n)], dtype=dtype)
    x: Array = np.empty((n, width), dtype=dtype)
    x[:, 0] = ids
    x[:, 1:] = ids[:, None] % 97 + np.arange(1, width)
    return x


@dataclass
class Recorder:
    """A BatchObserver keeping what it was told."""

    sizes: list[int] = field(default_factory=list)
    queue_ns: list[int] = field(default_factory=list)
    exec_ns: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)

    def on_batch(self, batch_rows: int, queue_ns: Sequence[int], exec_ns: int, ok: bool) -> None:
        self.sizes.append(batch_rows)
        self.queue_ns.extend(queue_ns)
        self.exec_ns.append(exec_ns)
        self.ok.append(ok)


class Gate:
    """A run function whose first call blocks until released, so a test can fill the queue behind it."""

    def __init__(self, inner: Any = triple) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, inputs: dict[str, Array]) -> dict[str, Array]:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.release.wait(10), "test never released the gate"
        result: dict[str, Array] = self.inner(inputs)
        return result


@pytest.fixture
def batchers() -> Iterator[list[DynamicBatcher]]:
    """Stops every batcher a test made, even when it fails, so no worker outlives its test."""
    made: list[DynamicBatcher] = []
    yield made
    for batcher in made:
        batcher.stop(timeout=5)


def make(batchers: list[DynamicBatcher], run: Any = triple, **overrides: Any) -> DynamicBatcher:
    options: dict[str, Any] = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256, "name": "m:1"}
    options.update(overrides)
    batcher = DynamicBatcher(run, **options)
    batchers.append(batcher)
    return batcher


def gated(batchers: list[DynamicBatcher], gate: Gate, **overrides: Any) -> tuple[DynamicBatcher, Future[Any]]:
    """A batcher whose worker is parked inside the gate's first call."""
    batcher = make(batchers, gate, **overrides)
    first = batcher.submit({"x": rows_for(999, 0, 1)})
    assert gate.entered.wait(5)
    return batcher, first


def test_concurrent_callers_get_exactly_their_own_rows(batchers: list[DynamicBatcher]) -> None:
    recorder = Recorder()

    def slow_triple(inputs: dict[str, Array]) -> dict[str, Array]:
        time.sleep(0.001)  # a model that takes a while, so callers queue up behind it
        return triple(inputs)

    batcher = make(batchers, slow_triple, max_batch_size=8, observer=recorder)
    clients, per_client = 64, 8
    start = threading.Barrier(clients)
    problems: list[str] = []
    sent_rows = [0] * clients

    def client(caller: int) -> None:
        rng = random.Random(caller)
        start.wait()
        for seq in range(per_client):
            x = rows_for(caller, seq, rng.randint(1, 3))
            sent_rows[caller] += len(x)
            out = batcher.submit({"x": x}).result(timeout=10)
            if set(out) != {"y", "id"} or not np.array_equal(out["y"], x * 3) or not np.array_equal(out["id"], x[:, 0]):
                problems.append(f"caller {caller} seq {seq}: got {out} for {x}")
            if out["y"].base is not None:
                problems.append(f"caller {caller} seq {seq}: answer is a view into a shared buffer")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert batcher.stop(timeout=5)
    assert problems == []

    stats = batcher.stats()
    assert stats.requests == clients * per_client
    assert stats.rows == sum(sent_rows) == sum(recorder.sizes)
    assert stats.failures == stats.rejected == 0
    assert stats.batches == len(recorder.sizes) < stats.requests  # batches formed...
    assert max(recorder.sizes) > 1
    assert max(recorder.sizes) <= 8  # ...and never over the cap
    assert len(recorder.queue_ns) == stats.requests
    assert all(ok for ok in recorder.ok)
    assert stats.queue_ns_total == sum(recorder.queue_ns)
    assert stats.exec_ns_total == sum(recorder.exec_ns) >= stats.batches * 1_000_000
    assert abs(stats.last_inference_ms - time.time() * 1000) < 10_000


def test_requests_are_never_split_and_the_cap_holds(batchers: list[DynamicBatcher]) -> None:
    gate, recorder = Gate(), Recorder()
    batcher, first = gated(batchers, gate, max_batch_size=8, observer=recorder)
    sizes = [5, 5, 3, 2, 8, 1]  # FIFO packing: 5 | 5+3 | 2 | 8 | 1 (a request that does not fit waits)
    futures = [batcher.submit({"x": rows_for(1, seq, n)}) for seq, n in enumerate(sizes)]
    gate.release.set()
    for seq, (n, future) in enumerate(zip(sizes, futures, strict=True)):
        assert np.array_equal(future.result(5)["y"], rows_for(1, seq, n) * 3)
    first.result(5)
    assert batcher.stop(5)
    assert recorder.sizes == [1, 5, 8, 2, 8, 1]


def test_mixed_names_dtypes_and_shapes_are_never_concatenated(batchers: list[DynamicBatcher]) -> None:
    def model(inputs: dict[str, Array]) -> dict[str, Array]:
        name = next(iter(inputs))
        return {"y": inputs[name] * 3}

    gate, recorder = Gate(model), Recorder()
    batcher, first = gated(batchers, gate, observer=recorder)
    kinds: list[tuple[str, int, type]] = [
        ("x", 4, np.float32),
        ("x", 5, np.float32),
        ("x", 4, np.float64),
        ("z", 4, np.float32),
    ]
    submitted = []
    for seq in range(5):  # interleaved, so every neighbour in the queue is incompatible
        for kind, (name, width, dtype) in enumerate(kinds):
            x = rows_for(kind, seq, 1, width=width, dtype=dtype)
            submitted.append((x, batcher.submit({name: x})))
    gate.release.set()
    first.result(5)
    for x, future in submitted:
        y = future.result(5)["y"]
        # float32 concatenated with float64 would come back float64; widths 4 and 5 would not concatenate.
        assert y.dtype == x.dtype
        assert np.array_equal(y, x * 3)
    assert batcher.stop(5)
    # After the gate: one batch per kind, in order of each kind's first request.
    assert recorder.sizes == [1, 5, 5, 5, 5]


def test_a_full_queue_refuses_with_overloaded_then_recovers(batchers: list[DynamicBatcher]) -> None:
    gate = Gate()
    batcher, first = gated(batchers, gate, max_queue_size=4)
    accepted = [batcher.submit({"x": rows_for(2, seq, 1)}) for seq in range(4)]
    with pytest.raises(Overloaded, match=r"queue is full \(4 requests waiting, max_queue_size 4\)"):
        batcher.submit({"x": rows_for(2, 9, 1)})
    assert batcher.stats().rejected == 1
    gate.release.set()
    for seq, future in enumerate(accepted):
        assert np.array_equal(future.result(5)["y"], rows_for(2, seq, 1) * 3)
    first.result(5)
    again = batcher.submit({"x": rows_for(2, 10, 1)})
    assert np.array_equal(again.result(5)["y"], rows_for(2, 10, 1) * 3)


def test_sustained_overload_is_bounded_and_recovers(batchers: list[DynamicBatcher]) -> None:
    depths: list[int] = []
    holder: list[DynamicBatcher] = []

    def slow_triple(inputs: dict[str, Array]) -> dict[str, Array]:
        depths.append(holder[0].stats().queued)
        time.sleep(0.005)  # capacity: 2 rows per 5 ms, about 400 rows/s
        return triple(inputs)

    batcher = make(batchers, slow_triple, max_batch_size=2, max_queue_size=4)
    holder.append(batcher)
    clients, duration = 24, 0.4  # 24 closed-loop callers against a queue of 4: several times capacity
    ok = [0] * clients
    refused = [0] * clients
    wrong: list[int] = []
    stop_at = time.monotonic() + duration

    def client(caller: int) -> None:
        seq = 0
        while time.monotonic() < stop_at:
            seq += 1
            x = rows_for(caller, seq, 1)
            try:
                future = batcher.submit({"x": x})
            except Overloaded:
                refused[caller] += 1
                time.sleep(0.001)
                continue
            if not np.array_equal(future.result(5)["y"], x * 3):
                wrong.append(caller)
            ok[caller] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    stats = batcher.stats()
    assert wrong == []
    assert sum(refused) == stats.rejected > sum(ok)  # most of the offered load was refused...
    assert sum(ok) == stats.requests > 0  # ...while the accepted part was served
    assert stats.peak_queued <= 4
    assert max(depths) <= 4
    assert stats.queued == 0
    # Recovery: with the load gone, a new request is accepted and answered.
    x = rows_for(99, 1, 2)
    assert np.array_equal(batcher.submit({"x": x}).result(5)["y"], x * 3)


def test_stop_drains_queued_work_and_refuses_new(batchers: list[DynamicBatcher]) -> None:
    gate = Gate()
    batcher, first = gated(batchers, gate, name="drain:1")
    queued = [batcher.submit({"x": rows_for(3, seq, 1 + seq % 3)}) for seq in range(20)]
    assert batcher.stop(timeout=0) is False  # refuses new work at once; the worker is still busy
    with pytest.raises(ModelNotReady, match="stopping"):
        batcher.submit({"x": rows_for(3, 99, 1)})
    gate.release.set()
    assert batcher.stop(timeout=5) is True
    first.result(0)
    for seq, future in enumerate(queued):
        assert future.done()
        assert np.array_equal(future.result(0)["y"], rows_for(3, seq, 1 + seq % 3) * 3)
    with pytest.raises(ModelNotReady):
        batcher.submit({"x": rows_for(3, 100, 1)})
    assert not any(t.name == "drain:1" and t.is_alive() for t in threading.enumerate())


def test_a_failing_run_fails_exactly_its_batch(batchers: list[DynamicBatcher]) -> None:
    def picky(inputs: dict[str, Array]) -> dict[str, Array]:
        if (inputs["x"][:, 0] < 0).any():
            raise ValueError("poisoned row")
        return triple(inputs)

    gate, recorder = Gate(picky), Recorder()
    batcher, first = gated(batchers, gate, max_batch_size=3, observer=recorder)
    poisoned = rows_for(4, 0, 1)
    poisoned[0, 0] = -1
    bad = [batcher.submit({"x": x}) for x in (rows_for(4, 1, 1), poisoned, rows_for(4, 2, 1))]
    good = [batcher.submit({"x": rows_for(4, seq, 1)}) for seq in (3, 4, 5)]
    gate.release.set()
    first.result(5)
    for future in bad:
        with pytest.raises(ValueError, match="poisoned row"):
            future.result(5)
    for seq, future in zip((3, 4, 5), good, strict=True):
        assert np.array_equal(future.result(5)["y"], rows_for(4, seq, 1) * 3)
    assert batcher.stop(5)
    assert recorder.ok == [True, False, True]
    assert recorder.sizes == [1, 3, 3]
    stats = batcher.stats()
    assert (stats.requests, stats.failures, stats.batches) == (7, 3, 3)


def test_an_output_without_the_batch_dimension_fails_the_batch(batchers: list[DynamicBatcher]) -> None:
    def collapsing(inputs: dict[str, Array]) -> dict[str, Array]:
        return {"y": inputs["x"] * 3, "total": inputs["x"].sum(axis=0)}

    gate = Gate(collapsing)
    batcher, first = gated(batchers, gate)
    futures = [batcher.submit({"x": rows_for(5, seq, 2, width=3)}) for seq in range(2)]
    gate.release.set()
    for future in futures:
        with pytest.raises(RuntimeFailure, match=r"output 'total' has shape \(3,\) but the batch has 4 rows"):
            future.result(5)
    with pytest.raises(RuntimeFailure, match="output 'total'"):
        first.result(5)  # the gate's own batch: 1 row, 'total' of shape (4,)


def test_invalid_batches_are_refused_at_submit(batchers: list[DynamicBatcher]) -> None:
    batcher = make(batchers, max_batch_size=8)
    with pytest.raises(InvalidInput, match="batch size 9 exceeds max_batch_size 8"):
        batcher.submit({"x": rows_for(6, 0, 9)})
    with pytest.raises(InvalidInput, match="batch size 0"):
        batcher.submit({"x": np.zeros((0, 4))})
    with pytest.raises(InvalidInput, match="disagree on the batch size"):
        batcher.submit({"x": np.zeros((2, 4)), "mask": np.zeros((3, 4))})
    with pytest.raises(InvalidInput, match="'x' is a scalar"):
        batcher.submit({"x": np.asarray(np.float32(1.0))})
    with pytest.raises(InvalidInput, match="at least one input"):
        batcher.submit({})
    x = rows_for(6, 1, 8)  # exactly at the cap is fine
    assert np.array_equal(batcher.submit({"x": x}).result(5)["y"], x * 3)


def test_a_queue_delay_gathers_sequential_requests(batchers: list[DynamicBatcher]) -> None:
    recorder = Recorder()
    batcher = make(batchers, max_queue_delay_us=300_000, observer=recorder)
    xs = [rows_for(7, seq, 1) for seq in range(3)]
    futures = [batcher.submit({"x": x}) for x in xs]  # one thread, back to back: the worker waits for them
    for x, future in zip(xs, futures, strict=True):
        assert np.array_equal(future.result(5)["y"], x * 3)
    assert batcher.stop(5)
    assert recorder.sizes == [3]


def test_stop_does_not_wait_out_the_queue_delay(batchers: list[DynamicBatcher]) -> None:
    batcher = make(batchers, max_queue_delay_us=30_000_000)
    future = batcher.submit({"x": rows_for(7, 9, 1)})
    started = time.monotonic()
    assert batcher.stop(timeout=5)
    assert time.monotonic() - started < 2  # drained at once, not after the 30 s delay
    assert np.array_equal(future.result(0)["y"], rows_for(7, 9, 1) * 3)


def test_no_delay_runs_a_lone_request_at_once(batchers: list[DynamicBatcher]) -> None:
    batcher = make(batchers, max_queue_delay_us=0)
    started = time.monotonic()
    batcher.submit({"x": rows_for(8, 0, 1)}).result(5)
    assert time.monotonic() - started < 0.5  # nothing like a timer: well under any configured delay


def test_cancelled_requests_never_run(batchers: list[DynamicBatcher]) -> None:
    gate, recorder = Gate(), Recorder()
    batcher, first = gated(batchers, gate, observer=recorder)
    dropped = batcher.submit({"x": rows_for(9, 0, 1)})
    kept = batcher.submit({"x": rows_for(9, 1, 1)})
    assert dropped.cancel()
    gate.release.set()
    assert np.array_equal(kept.result(5)["y"], rows_for(9, 1, 1) * 3)
    first.result(5)
    assert batcher.stop(5)
    assert recorder.sizes == [1, 1]
    assert batcher.stats().cancelled == 1


def test_a_failing_observer_does_not_stop_batching(
    batchers: list[DynamicBatcher], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def on_batch(self, batch_rows: int, queue_ns: Sequence[int], exec_ns: int, ok: bool) -> None:
            raise RuntimeError("metrics backend down")

    batcher = make(batchers, observer=Broken())
    for seq in range(3):
        x = rows_for(10, seq, 1)
        assert np.array_equal(batcher.submit({"x": x}).result(5)["y"], x * 3)
    assert batcher.stop(5)
    assert "batch observer failed for model m:1" in caplog.text


def test_the_worker_thread_is_a_named_daemon(batchers: list[DynamicBatcher]) -> None:
    make(batchers, name="resnet:3")
    workers = [t for t in threading.enumerate() if t.name == "resnet:3"]
    assert len(workers) == 1
    assert workers[0].daemon


@pytest.mark.parametrize(
    ("option", "value"), [("max_batch_size", 0), ("max_queue_delay_us", -1), ("max_queue_size", 0)]
)
def test_bad_configuration_is_refused(option: str, value: int) -> None:
    options: dict[str, Any] = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 8, "name": "m:1"}
    options[option] = value
    with pytest.raises(ValueError, match=option):
        DynamicBatcher(triple, **options)


def test_call_blocks_for_its_own_rows_and_mixes_with_submit(batchers: list[DynamicBatcher]) -> None:
    """The server's hot path (``call``, one lock per request) batches with futures and keeps rows apart."""
    seen: list[tuple[dict[str, Array], dict[str, Array]]] = []
    batcher = make(batchers, max_batch_size=8, on_outputs=lambda i, o: seen.append((i, o)))
    problems: list[str] = []

    def caller(index: int) -> None:
        for seq in range(20):
            x = rows_for(index, seq, 1 + seq % 2)
            out = batcher.call({"x": x}, len(x), signature({"x": x}))
            if not np.array_equal(out["y"], x * 3):
                problems.append(f"caller {index} seq {seq}: {out['y']} for {x}")

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    futures = [batcher.submit({"x": rows_for(99, seq, 1)}) for seq in range(10)]
    for thread in threads:
        thread.join(30)
    assert all(np.array_equal(f.result(5)["y"], rows_for(99, seq, 1) * 3) for seq, f in enumerate(futures))
    assert problems == []
    assert batcher.stop(timeout=5)
    # The hook saw every successful batch: its inputs and outputs, row for row.
    assert sum(len(inputs["x"]) for inputs, _ in seen) == batcher.stats().rows == 16 * 30 + 10
    for inputs, outputs in seen:
        np.testing.assert_array_equal(outputs["y"], inputs["x"] * 3)


def test_call_raises_the_batch_error_and_refuses_a_bad_row_count(batchers: list[DynamicBatcher]) -> None:
    def broken(inputs: dict[str, Array]) -> dict[str, Array]:
        raise RuntimeError("engine lost")

    hooked: list[Any] = []
    batcher = make(batchers, broken, max_batch_size=2, on_outputs=lambda i, o: hooked.append(i))
    x = rows_for(1, 0, 1)
    with pytest.raises(RuntimeError, match="engine lost"):
        batcher.call({"x": x}, 1, signature({"x": x}))
    assert hooked == []  # failed batches are not monitored
    three = rows_for(1, 1, 3)
    with pytest.raises(InvalidInput, match="batch size 3; expected 1 to 2"):
        batcher.call({"x": three}, 3, signature({"x": three}))
    assert batcher.stop(timeout=5)
    with pytest.raises(ModelNotReady):
        batcher.call({"x": x}, 1, signature({"x": x}))


def test_a_failing_output_hook_does_not_stop_batching(batchers: list[DynamicBatcher]) -> None:
    def broken_hook(inputs: dict[str, Array], outputs: dict[str, Array]) -> None:
        raise ValueError("monitor bug")

    batcher = make(batchers, on_outputs=broken_hook)
    for seq in range(3):
        x = rows_for(2, seq, 1)
        assert np.array_equal(batcher.call({"x": x}, 1, signature({"x": x}))["y"], x * 3)


def test_a_lone_call_runs_on_the_callers_thread_and_queued_ones_batch_on_the_worker(
    batchers: list[DynamicBatcher],
) -> None:
    """With the worker asleep on an empty queue ``call`` runs the request itself (no hand-off); while a
    batch runs, callers queue and the worker batches them; either way stats, observer and hook see all."""
    threads_seen: list[str] = []

    def run(inputs: dict[str, Array]) -> dict[str, Array]:
        threads_seen.append(threading.current_thread().name)
        return triple(inputs)

    gate = Gate(run)
    recorder, hooked = Recorder(), []
    batcher = make(
        batchers, run, max_batch_size=8, observer=recorder, on_outputs=lambda i, o: hooked.append(len(i["x"]))
    )
    deadline = time.monotonic() + 5
    while not batcher.worker_idle and time.monotonic() < deadline:  # the worker reaches its empty queue
        time.sleep(0.01)
    x = rows_for(1, 0, 2)
    assert np.array_equal(batcher.call({"x": x}, 2, signature({"x": x}))["y"], x * 3)
    assert threads_seen == [threading.current_thread().name], "a lone request runs on the caller's thread"
    assert batcher.stats().requests == 1 and recorder.sizes == [2] and hooked == [2]

    # A batch in flight (the gate holds the first inline call): the others queue for the worker.
    gate_batcher = make(batchers, gate, max_batch_size=8, name="gated:1")
    while not gate_batcher.worker_idle and time.monotonic() < deadline:
        time.sleep(0.01)
    first = threading.Thread(target=gate_batcher.call, args=({"x": rows_for(2, 0, 1)}, 1, signature({"x": x})))
    first.start()
    assert gate.entered.wait(5)
    answers: list[bool] = []

    def caller(index: int) -> None:
        rows = rows_for(3, index, 1)
        answers.append(np.array_equal(gate_batcher.call({"x": rows}, 1, signature({"x": rows}))["y"], rows * 3))

    others = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
    for thread in others:
        thread.start()
    while gate_batcher.stats().queued < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert answers == [True] * 6
    stats = gate_batcher.stats()
    assert stats.requests == 7 and stats.batches == 2, stats  # the inline one, then the six in one batch
    assert threads_seen[-2:] == [first.name, "gated:1"], threads_seen

    # After a batch of several, more callers are on their way: the next request goes to the worker even
    # though it sleeps on an empty queue; after that lone batch, requests run inline again.
    for expected in ("gated:1", threading.current_thread().name):
        while not gate_batcher.worker_idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert np.array_equal(gate_batcher.call({"x": x}, 2, signature({"x": x}))["y"], x * 3)
        assert threads_seen[-1] == expected, threads_seen
    assert gate_batcher.stop(timeout=5)

    # With a queue delay a lone request waits for company on the worker, as configured.
    delayed_threads: list[str] = []

    def delayed_run(inputs: dict[str, Array]) -> dict[str, Array]:
        delayed_threads.append(threading.current_thread().name)
        return triple(inputs)

    delayed = make(batchers, delayed_run, max_queue_delay_us=30_000, name="delayed:1")
    while not delayed.worker_idle and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    assert np.array_equal(delayed.call({"x": x}, 2, signature({"x": x}))["y"], x * 3)
    assert delayed_threads == ["delayed:1"] and time.monotonic() - start >= 0.025
    with pytest.raises(ModelNotReady):
        batcher.stop(timeout=5)
        batcher.call({"x": x}, 2, signature({"x": x}))
