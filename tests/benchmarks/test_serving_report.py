"""The serving benchmark's arithmetic: same-repeat ratios, verdicts, the ``--out`` summary's shape."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.serving_report import (
    KSERVE,
    LIMIT,
    NATIVE,
    NATIVE_REC,
    OFF,
    OURS,
    REFERENCE,
    TITLES,
    TRITON,
    Point,
    Repeat,
    Row,
    limit_row,
    main_table,
    pairs_line,
    server_row,
    summary,
    targets,
)


def row(c1: float, c32: float, medium: float, p50: float = 1.0) -> Row:
    return Row(Point(c1, p50), Point(c32, 20.0), Point(medium, 900.0))


def repeat(ours: float, triton: float, kserve: float, *, off: float | None = None) -> Repeat:
    rows = {
        OURS: row(600, ours, 27, p50=1.2),
        REFERENCE: row(700, 1000, 27),
        TRITON: row(130, triton, 20),
        KSERVE: row(650, kserve, 26, p50=1.5),
        LIMIT: row(3900, 4000, 28),
    }
    if off is not None:
        rows[OFF] = Row(None, Point(off, 20.0), Point(27, 900.0))
    return Repeat(rows)


def test_each_ratio_is_taken_within_a_repeat_then_the_median() -> None:
    # Repeat 1 is a slow minute for everyone, repeat 2 a fast one: ours is 2x Triton in both, though ours
    # in the slow one is below Triton in the fast one.
    found = {t.name: t for t in targets([repeat(1000, 500, 600), repeat(2000, 1000, 1200)])}

    assert found["small c=32: ours / Triton"].observed == "2.00x"
    assert found["small c=32: ours / Triton"].passed is True
    assert found["small c=32: ours / KServe"].observed == "1.67x"
    assert found["small c=1 p50: ours / KServe"].observed == "0.80x"
    assert found["small c=1 p50: ours / KServe"].passed is True
    assert found["small c=32: ours / grpcio reference"].passed is True  # 100% and 200%: median 150%
    assert found["medium c=32: ours / ORT limit"].observed == "96.4%"
    assert found["medium c=32: ours / ORT limit"].passed is False


def test_a_server_not_measured_gives_no_verdict() -> None:
    bare = Repeat({OURS: row(600, 1000, 27), REFERENCE: row(700, 1000, 27), LIMIT: row(3900, 4000, 28)})

    found = {t.name: t for t in targets([bare])}

    assert found["small c=32: ours / Triton"].passed is None
    assert found["small c=32: observability cost (1 - on / off)"].observed == "not measured"


def test_observability_cost_is_one_minus_on_over_off() -> None:
    found = {t.name: t for t in targets([repeat(900, 500, 600, off=1000)])}

    assert found["small c=32: observability cost (1 - on / off)"].observed == "10.0%"
    assert found["small c=32: observability cost (1 - on / off)"].passed is True
    assert found["medium c=32: observability cost (1 - on / off)"].observed == "0.0%"


def test_summary_has_the_issue_shape() -> None:
    out = summary([repeat(1000, 500, 600), repeat(1200, 500, 600)])

    assert set(out) == {"ours", "reference", "limit", "peers"}
    assert set(out["peers"]) == {"triton", "kserve"}
    for section in (out["ours"], out["reference"], out["limit"], *out["peers"].values()):
        assert set(section) == {"small_c1", "small_c32", "medium_c32"}
        assert all(set(point) == {"infer_per_s", "p50_ms"} for point in section.values())
    assert out["ours"]["small_c32"]["infer_per_s"] == 1100  # median of the repeats


def test_summary_without_peers_has_an_empty_peer_section() -> None:
    bare = Repeat({OURS: row(600, 1000, 27), REFERENCE: row(700, 1000, 27), LIMIT: row(3900, 4000, 28)})

    assert summary([bare])["peers"] == {}


def test_the_native_reference_is_reported_beside_the_others_and_judged_by_no_target() -> None:
    repeats = [repeat(1000, 500, 600), repeat(1200, 500, 600)]
    for found, native in zip(repeats, (1500, 1700), strict=True):
        found.rows[NATIVE] = row(900, native, 27.5)
        found.rows[NATIVE_REC] = Row(None, Point(native * 0.9, 11.0), Point(27.0, 900.0))

    out = summary(repeats)
    table = "\n".join(main_table(repeats, TITLES))

    assert out["native_reference"]["small_c32"]["infer_per_s"] == 1600
    assert "| native / Triton (same repeat, median) | 6.92x (p50 1.00x) | 3.20x |" in table
    assert "| native / grpcio reference (same repeat, median) | 1.29x (p50 1.00x) | 1.60x |" in table
    assert "| ours / native reference (same repeat, median) |" in table
    assert "| native recorded / Triton (same repeat, median) | – | 2.88x |" in table
    assert out["native_reference_recorded"]["small_c32"]["infer_per_s"] == 1440
    assert out["native_reference_recorded"]["small_c1"] is None
    assert {t.name for t in targets(repeats)} == {t.name for t in targets([repeat(1000, 500, 600)])}
    assert "native_reference" not in summary([repeat(1000, 500, 600)])


def v2(label: str, model: str, concurrency: int, rate: float, errors: int = 0) -> dict[str, Any]:
    return {
        "kind": "v2grpc",
        "label": label,
        "model": model,
        "concurrency": concurrency,
        "infer_per_s": rate,
        "p50_ms": 1.5,
        "errors": errors,
        "first_error": "UNAVAILABLE: gone" if errors else None,
    }


def test_server_row_refuses_a_point_with_errors() -> None:
    lines = [v2("ours", "small", 1, 600), v2("ours", "small", 32, 900, errors=3), v2("ours", "medium", 32, 25)]

    with pytest.raises(RuntimeError, match="ours small c=32: 3 errors: UNAVAILABLE"):
        server_row(lines, "ours")


def test_limit_row_takes_batch_one_for_c1_and_the_best_batch_for_the_rest() -> None:
    lines = [
        {"kind": "ort_limit", "model": model, "batch": batch, "infer_per_s": rate, "p50_ms": 0.1 * batch}
        for model, batch, rate in (("small", 1, 3900), ("small", 8, 4100), ("small", 32, 4000), ("medium", 1, 27))
    ]

    found = limit_row(lines)

    assert found.small_c1 == Point(3900, 0.1, 1)
    assert found.small_c32 is not None and found.small_c32.batch == 8
    assert found.medium_c32 is not None and found.medium_c32.batch == 1


def test_interleaved_pairs_judge_the_medium_target_when_a_run_has_them() -> None:
    # The repeats' own ratio (27 / 28 = 96.4%) would miss; the pairs' median (97.8%) passes, and names them.
    first, second = repeat(1000, 500, 600), repeat(2000, 1000, 1200)
    first.medium_pairs = [(44.0, 45.0), (40.0, 50.0)]
    second.medium_pairs = [(47.0, 48.0)]

    found = {t.name: t for t in targets([first, second])}

    medium = found["medium c=32: ours / ORT limit (3 interleaved pairs, median)"]
    assert medium.observed == "97.8%" and medium.passed is True
    assert "medium c=32: ours / ORT limit" not in found
    assert pairs_line([first, second]) == (
        "medium c=32, ours / ORT limit per interleaved pair: 97.8%, 80.0%, 97.9% (median 97.8%)"
    )
    assert pairs_line([repeat(1000, 500, 600)]) is None
