"""The serving benchmark's cores points (a worker left without a connection is loaded again) and its
interleaved medium pairs."""

from __future__ import annotations

import pytest

from benchmarks.serving_report import LIMIT, Point
from benchmarks.serving_throughput import PAIRS, idle_workers, pairs_of, to_repeat


def test_a_worker_without_a_connection_is_seen() -> None:
    assert idle_workers([17.26, 0.09, 0.03], workers=2)  # both connections hashed to one worker
    assert not idle_workers([10.65, 10.42, 0.03], workers=2)  # the supervisor's 0.03 is not a worker
    assert not idle_workers([15.0], workers=1)


def test_medium_pairs_are_read_in_order_and_kept_out_of_the_rows() -> None:
    lines = [
        {"kind": "ort_limit", "model": "medium", "batch": 8, "infer_per_s": 48.0, "p50_ms": 160.0},
        {"kind": "ort_limit", "model": "small", "batch": 1, "infer_per_s": 3900.0, "p50_ms": 0.2},
        {"kind": "ort_limit", "model": "small", "batch": 8, "infer_per_s": 4000.0, "p50_ms": 2.0},
        {"kind": "v2grpc", "label": PAIRS, "pair": 1, "infer_per_s": 44.0, "errors": 0},
        {"kind": "ort_limit", "model": "medium", "batch": 8, "infer_per_s": 46.0, "p50_ms": 170.0, "pair": 1},
        {"kind": "ort_limit", "model": "medium", "batch": 8, "infer_per_s": 50.0, "p50_ms": 150.0, "pair": 0},
        {"kind": "v2grpc", "label": PAIRS, "pair": 0, "infer_per_s": 45.0, "errors": 0},
        {"kind": "v2grpc", "label": PAIRS, "pair": 2, "infer_per_s": 45.0, "errors": 0},  # its limit never ran
    ]

    assert pairs_of(lines) == [(45.0, 50.0), (44.0, 46.0)]
    # The pairs' limit points are not the limit row's: 50 would otherwise be the best medium batch.
    assert to_repeat(lines).rows[LIMIT].medium_c32 == Point(48.0, 160.0, 8)


def test_a_pair_whose_server_answered_with_errors_fails_the_run() -> None:
    lines = [{"kind": "v2grpc", "label": PAIRS, "pair": 0, "infer_per_s": 45.0, "errors": 2, "first_error": "INTERNAL"}]

    with pytest.raises(RuntimeError, match="medium pair 0: 2 errors: INTERNAL"):
        pairs_of(lines)
