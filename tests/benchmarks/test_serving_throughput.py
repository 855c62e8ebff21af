"""The serving benchmark's cores points: a worker left without a connection is loaded again."""

from __future__ import annotations

from benchmarks.serving_throughput import idle_workers


def test_a_worker_without_a_connection_is_seen() -> None:
    assert idle_workers([17.26, 0.09, 0.03], workers=2)  # both connections hashed to one worker
    assert not idle_workers([10.65, 10.42, 0.03], workers=2)  # the supervisor's 0.03 is not a worker
    assert not idle_workers([15.0], workers=1)
