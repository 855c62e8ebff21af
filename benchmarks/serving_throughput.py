"""Serving throughput: our KServe V2 gRPC server against the peers and a same-run grpcio reference,
measured with the peers' own harness.

Builds the harness's ``small`` (3-conv CNN, [N,3,64,64] -> 4 classes) and ``medium`` (ResNet-18-like,
[N,3,224,224] -> 1000 classes) models with ``bench/make_models.py``, wraps them into a temporary model
repository (with a drift baseline, so telemetry on runs every monitor), starts ``python -m serving`` on
core 1 (``taskset -c 1``, ONNX Runtime one intra-op thread, 127.0.0.1 only) and loads it from core 0
with the closed-loop client the peers were measured with (``bench/v2load.py``: one grpc.aio channel, C
requests in flight, a fixed warm-up then a fixed window). Correctness first (``v2load.py check`` against
``<model>.ref.npz``); the limit is ``bench/ort_limit.py`` (in-process ``session.run`` on core 1, same
session settings, no network), best batch per model. In every repeat the grpcio reference
(``benchmarks/reference_server.py``: a minimal synchronous grpcio server with a dynamic batcher, max
batch 8) is measured the same way, right before or after ours (the order alternates between repeats).

The peer rows are constants: the figures the harness measured for the serving issue, same cores, same
client, same durations, on a day when this VM was faster (its ORT limit is in the table). Targets, as
the issue states them: small c=32 >= 2,400 inferences/s, small c=1 p50 <= 0.8 ms, medium c=32 >= 97% of
the limit. Because the VM's speed moves by ±20% between runs, the same run also judges relative
targets: small c=32 >= 95% of the reference's throughput and small c=1 p50 <= 1.05x the reference's
(each ratio per repeat, then the median). "Scaled to the peers' machine" multiplies our small points by
(peer-table ORT limit / this run's ORT limit): an estimate, not a measurement.

Durations: 12 s per point after 3 s of warm-up, median of 2 whole runs, like the peers; ``--quick`` (4 s
/ 1 s, one run), ``--duration``, ``--warmup``, ``--repeats``, or ``SLUICEGATE_BENCH_SECONDS`` (the default
of ``--duration``, for ``make bench``). Server settings pass through from ``SLUICEGATE_SERVING__*`` (e.g.
``GRPC_WORKERS``, ``TELEMETRY``), except ORT_THREADS=1. The table notes how much CPU other processes took
during the run (2 cores: anything else lands on the server's or the client's) and warns above 0.1 core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving_harness import (
    MODELS,
    NOISE_CORES,
    Server,
    build_repository,
    check,
    cpu_seconds,
    default_bench_dir,
    fill_defaults,
    json_lines,
    log_problems,
    model_files,
    others_cores,
    pinning,
    progress,
    require_harness,
    revision,
    run_load,
    running_reference,
    running_server,
    v2_point,
)

PEERS_MEASURED = "measured by the harness, 2026-11-29"
TARGET_SMALL_C32 = 2_400.0  # inferences/s
TARGET_SMALL_C1_P50_MS = 0.8
TARGET_MEDIUM_SHARE = 0.97  # of this run's ORT limit
TARGET_REFERENCE_SHARE = 0.95  # small c=32 throughput, of the grpcio reference's in the same repeat
TARGET_REFERENCE_P50 = 1.05  # small c=1 p50, times the grpcio reference's in the same repeat
# Small: a cap of 8 beat 32 by 9% with a lower p99 (FACTS "Serving on grpcio"). Medium: ~35 ms of ORT per
# image, so per-request overhead is about 1% and ORT's throughput hardly depends on the batch (batches 1, 8
# and 32 trade places from run to run here, README); batching only has to keep the core busy between
# requests. 8 does that at c=32 while a batch stays near 0.3 s (1.1 s at 32, and a request waits for its
# whole batch); caps of 1, 8 and 32 served medium at the same rate.
DEFAULT_MAX_BATCH = {"small": 8, "medium": 8}
REFERENCE_MAX_BATCH = 8  # the yardstick stays fixed when ours is tried with other caps
POINTS = (("small", 1), ("small", 32), ("medium", 32))  # (model, concurrency), in the table's column order
FIELDS = ("small_c1", "small_c32", "medium_c32")
OURS, REFERENCE = "sluicegate", "grpcio-reference"  # v2load labels


@dataclass(frozen=True)
class Point:
    """One measured point: inferences/s, client-side p50 (ms), and the batch of an ORT limit point."""

    infer_per_s: float
    p50_ms: float | None = None
    batch: int | None = None


@dataclass(frozen=True)
class Row:
    server: str
    small_c1: Point
    small_c32: Point
    medium_c32: Point


PEERS = (
    Row("Seldon MLServer 1.7.1", Point(390, 2.5), Point(405), Point(20)),
    Row("KServe 0.21 ModelServer", Point(1_004, 0.98), Point(1_280), Point(28)),
    Row("Triton 2.51 via PyTriton, dynamic batching", Point(197, 4.9), Point(1_567), Point(30)),
)
HARNESS_LIMIT = Row("raw ONNX Runtime in-process (the limit)", Point(4_679, 0.21), Point(4_865, batch=8), Point(31))


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "issue (absolute)", "same run (relative)", or both
    observed: str
    threshold: str
    passed: bool


@dataclass(frozen=True)
class Repeat:
    """One repeat's rows: ours, the grpcio reference and the in-process limit, measured minutes apart."""

    ours: Row
    reference: Row
    limit: Row


def load_server(
    client: list[str], bench: Path, models: Path, server: Server, label: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Check each model's answer, then load it: small at c=1 and 32, medium at c=32."""
    lines: list[dict[str, Any]] = []
    for model in MODELS:
        progress(f"{label} {model}: check, then load for {args.duration:g} s per point...")
        check(client, bench, models, server.target, model, label)
        concurrency = "1,32" if model == "small" else "32"
        lines += run_load(client, bench, server.target, model, concurrency, (args.duration, args.warmup), label)
    return lines


def ort_limit(server: list[str], bench: Path, models: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    argv = [*server, sys.executable, str(bench / "ort_limit.py"), "--models-dir", str(models)]
    argv += ["--model", "small,medium", "--batch", args.ort_batches]
    argv += ["--duration", str(args.duration), "--warmup", str(args.warmup)]
    return json_lines(argv, env={**os.environ, "PEERBENCH_ORT_THREADS": "1"})


def server_row(lines: list[dict[str, Any]], label: str, title: str) -> Row:
    points = [v2_point(lines, model, concurrency, label) for model, concurrency in POINTS]
    return Row(title, *(Point(float(x["infer_per_s"]), float(x["p50_ms"])) for x in points))


def limit_row(lines: list[dict[str, Any]]) -> Row:
    """Batch 1 for c=1 (its p50 is per ``session.run``), the best batch for the loaded points."""
    ort = [x for x in lines if x["kind"] == "ort_limit"]

    def best(model: str) -> Point:
        top = max((x for x in ort if x["model"] == model), key=lambda x: float(x["infer_per_s"]))
        return Point(float(top["infer_per_s"]), batch=int(top["batch"]))

    (single,) = [x for x in ort if x["model"] == "small" and x["batch"] == 1]
    return Row("ORT limit (this run)", Point(float(single["infer_per_s"]), float(single["p50_ms"])), *map(best, MODELS))


def median_row(rows: list[Row]) -> Row:
    """Median of each point over the repeats (run_peers.sh repeats and summarize.py does the same)."""

    def median(field: str) -> Point:
        points = sorted((getattr(row, field) for row in rows), key=lambda p: p.infer_per_s)
        latencies = sorted(p.p50_ms for p in points if p.p50_ms is not None)
        return Point(
            statistics.median(p.infer_per_s for p in points),
            statistics.median(latencies) if latencies else None,
            points[len(points) // 2].batch,
        )

    return Row(rows[0].server, *(median(field) for field in FIELDS))


def spread(rows: list[Row]) -> dict[str, str]:
    """min–max inferences/s of each point over the repeats."""
    found = {}
    for field in FIELDS:
        rates = [getattr(row, field).infer_per_s for row in rows]
        found[field] = f"{min(rates):,.1f}–{max(rates):,.1f}"
    return found


def to_reference(repeats: list[Repeat], field: str, latency: bool = False) -> float:
    """Ours / the reference's, throughput (or p50), per repeat and then the median: the two were measured
    minutes apart, so each repeat's pair shares that repeat's machine speed."""
    ratios = []
    for repeat in repeats:
        mine, ref = getattr(repeat.ours, field), getattr(repeat.reference, field)
        ratios.append((mine.p50_ms or 0.0) / (ref.p50_ms or 1.0) if latency else mine.infer_per_s / ref.infer_per_s)
    return statistics.median(ratios)


def scaled(row: Row, limit: Row) -> Row:
    """An estimate of ``row``'s small points on the peers' machine: x (peer-table limit / this run's)."""
    c1 = HARNESS_LIMIT.small_c1.infer_per_s / limit.small_c1.infer_per_s
    c32 = HARNESS_LIMIT.small_c32.infer_per_s / limit.small_c32.infer_per_s
    p50 = row.small_c1.p50_ms / c1 if row.small_c1.p50_ms is not None else None
    return Row(
        f"{row.server.replace(' (this run)', '')} scaled to the peers' machine (estimate)",
        Point(row.small_c1.infer_per_s * c1, p50),
        Point(row.small_c32.infer_per_s * c32),
        Point(float("nan")),
    )


def cell(value: Point) -> str:
    if value.infer_per_s != value.infer_per_s:  # NaN: not estimated
        return "–"
    rate = f"{value.infer_per_s:,.0f}" if value.infer_per_s >= 100 else f"{value.infer_per_s:.1f}"
    if value.batch is not None:
        return f"{rate} (batch {value.batch})"
    return f"{rate} ({value.p50_ms:.2f})" if value.p50_ms is not None else rate


def judged(name: str, kind: str, observed: float, threshold: float, fmt: str, at_most: bool = False) -> Target:
    passed = observed <= threshold if at_most else observed >= threshold
    return Target(name, kind, fmt.format(observed), ("<= " if at_most else ">= ") + fmt.format(threshold), passed)


def targets(ours: Row, limit: Row, repeats: list[Repeat]) -> list[Target]:
    """The issue's targets as it states them, and the same-run ones the VM's noise allows judging."""
    share = ours.medium_c32.infer_per_s / limit.medium_c32.infer_per_s
    issue, same = "issue (absolute)", "same run (relative)"
    return [
        judged("small c=1 p50", issue, ours.small_c1.p50_ms or 0.0, TARGET_SMALL_C1_P50_MS, "{:.2f} ms", at_most=True),
        judged("small c=32", issue, ours.small_c32.infer_per_s, TARGET_SMALL_C32, "{:,.0f} infer/s"),
        judged("medium c=32 / ORT limit", f"{issue}; {same}", share, TARGET_MEDIUM_SHARE, "{:.1%}"),
        judged("small c=32 / reference", same, to_reference(repeats, "small_c32"), TARGET_REFERENCE_SHARE, "{:.1%}"),
        judged(
            "small c=1 p50 / reference",
            same,
            to_reference(repeats, "small_c1", latency=True),
            TARGET_REFERENCE_P50,
            "{:.2f}x",
            at_most=True,
        ),
    ]


def table_row(title: str, cells: list[str]) -> str:
    return f"| {title} | " + " | ".join(cells) + " |"


def markdown(ours: Row, reference: Row, limit: Row, repeats: list[Repeat], notes: dict[str, Any]) -> str:
    """The peer table with our rows, the reference's and the limit's, ratios, estimates and targets."""
    lines = [
        "| server | small c=1 infer/s (p50 ms) | small c=32 infer/s (p50 ms) | medium c=32 infer/s (p50 ms) |",
        "|---|---:|---:|---:|",
    ]
    for row in (*PEERS, HARNESS_LIMIT):
        lines.append(table_row(f"{row.server} ({PEERS_MEASURED})", [cell(getattr(row, f)) for f in FIELDS]))
    for row in (ours, reference, limit):
        lines.append(table_row(f"**{row.server}**", [cell(getattr(row, f)) for f in FIELDS]))
    to_peer, to_ref, to_limit = [], [], []
    for field in FIELDS:
        mine: Point = getattr(ours, field)
        peer = max((getattr(row, field) for row in PEERS), key=lambda p: p.infer_per_s)
        to_peer.append(f"{mine.infer_per_s / peer.infer_per_s:.2f}x")
        to_ref.append(f"{to_reference(repeats, field):.1%}")
        to_limit.append(f"{mine.infer_per_s / getattr(limit, field).infer_per_s:.1%}")
    best_c1 = max(PEERS, key=lambda row: row.small_c1.infer_per_s).small_c1
    if ours.small_c1.p50_ms is not None and best_c1.p50_ms is not None:
        to_peer[0] += f" (p50 {ours.small_c1.p50_ms / best_c1.p50_ms:.2f}x)"
    to_ref[0] += f" (p50 {to_reference(repeats, 'small_c1', latency=True):.2f}x)"
    lines.append(table_row("sluicegate / best peer", to_peer))
    lines.append(table_row("sluicegate / grpcio reference (same repeat, median)", to_ref))
    lines.append(table_row("sluicegate / ORT limit (this run)", to_limit))
    for row in (scaled(ours, limit), scaled(reference, limit)):
        lines.append(table_row(f"*{row.server}*", [cell(getattr(row, f)) for f in FIELDS]))
    lines += ["", "| target | kind | observed | threshold | verdict |", "|---|---|---:|---:|---|"]
    for target in targets(ours, limit, repeats):
        verdict = "PASS" if target.passed else "MISS"
        lines.append(f"| {target.name} | {target.kind} | {target.observed} | {target.threshold} | {verdict} |")
    lines += ["", *(f"- {key}: {value}" for key, value in notes.items())]
    return "\n".join(lines)


def measure_once(
    bench: Path, work: Path, repo: Path, pins: tuple[list[str], list[str]], repeat: int, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One repeat: the in-process limit on the server's core, then ours and the reference (fresh processes,
    ours first in even repeats, so neither always gets the warmer or the cooler minutes)."""
    server_cpu, client_cpu = pins
    progress("ORT limit (in process)...")
    limit_lines = ort_limit(server_cpu, bench, work / "models", args)
    lines: list[dict[str, Any]] = []
    for label in (OURS, REFERENCE) if repeat % 2 == 0 else (REFERENCE, OURS):
        if label == OURS:
            with running_server(repo, work, server_cpu) as server:
                lines += load_server(client_cpu, bench, work / "models", server, label, args)
        else:
            models = model_files(work)
            with running_reference(models, work, server_cpu, max_batch=REFERENCE_MAX_BATCH) as server:
                lines += load_server(client_cpu, bench, work / "models", server, label, args)
    return lines, limit_lines


def by_point(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's ORT limit per batch, and the client's largest CPU share per load point."""
    limit: dict[str, list[float]] = {}
    client: dict[str, float] = {}
    for line in lines:
        if line["kind"] == "ort_limit":
            limit.setdefault(f"{line['model']} b{line['batch']}", []).append(line["infer_per_s"])
        elif line["kind"] == "v2grpc":
            key = f"{line['label']} {line['model']} c={line['concurrency']}"
            client[key] = max(client.get(key, 0.0), line["client_cpu_util"])
    return {"ORT limit by batch (infer/s)": limit, "client_cpu_util (max; ~0.8+: client-bound)": client}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, help="seconds per point (12 like the peers; --quick: 4)")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up per point (3; --quick: 1)")
    parser.add_argument(
        "--repeats", type=int, help="whole runs, the table shows medians (2 like the peers; --quick: 1)"
    )
    parser.add_argument("--quick", action="store_true", help="shorter defaults for a smoke run")
    parser.add_argument("--bench-dir", type=Path, default=default_bench_dir(), help="the shared harness")
    parser.add_argument("--small-max-batch", type=int, default=DEFAULT_MAX_BATCH["small"])
    parser.add_argument("--medium-max-batch", type=int, default=DEFAULT_MAX_BATCH["medium"])
    parser.add_argument("--ort-batches", default="1,8,32", help="batch sizes of the in-process limit")
    parser.add_argument("--out", type=Path, default=Path("bench-results/serving_throughput.json"))
    quick = {"duration": 4.0, "warmup": 1.0, "repeats": 1}
    return fill_defaults(parser.parse_args(), quick, {"duration": 12.0, "warmup": 3.0, "repeats": 2})


Lines = list[dict[str, Any]]


def run_repeats(
    bench: Path, max_batch: dict[str, int], pins: tuple[list[str], list[str]], args: argparse.Namespace
) -> tuple[list[tuple[Lines, Lines]], dict[str, list[Any]]]:
    """Every repeat in a scratch folder (removed after): each repeat's (server lines, limit lines), and the
    warnings and errors of each server's log per repeat."""
    work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-serving-"))
    runs = []
    problems: dict[str, list[Any]] = {}
    try:
        repo = build_repository(bench, work, max_batch)
        for repeat in range(args.repeats):
            progress(f"repeat {repeat + 1}/{args.repeats}")
            runs.append(measure_once(bench, work, repo, pins, repeat, args))
            for label, log in ((OURS, work / "server.log"), (REFERENCE, work / "reference.log")):
                problems.setdefault(label, []).append(log_problems(log))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs, problems


def run_notes(
    args: argparse.Namespace,
    pin_note: str,
    busy: float,
    max_batch: dict[str, int],
    repeats: list[Repeat],
    every: Lines,
    problems: dict[str, list[Any]],
) -> dict[str, Any]:
    """How the run went: durations, pinning, revision, noise, caps, spread, and the servers' logs."""
    notes: dict[str, Any] = {
        "durations": f"{args.duration:g} s per point after {args.warmup:g} s warm-up; median of {args.repeats} run(s)",
        "pinning": pin_note,
        "server code": revision(),
        "other processes' CPU during the run": f"{busy:.2f} cores on average",
        "max_batch_size": {**max_batch, "grpcio reference": REFERENCE_MAX_BATCH},
        "spread over runs (infer/s)": {
            "sluicegate": spread([r.ours for r in repeats]),
            "grpcio reference": spread([r.reference for r in repeats]),
            "ORT limit": spread([r.limit for r in repeats]),
        },
        **by_point(every),
        "scaled rows": "estimate: this run's small points x (peer-table ORT limit / this run's, batch 1 for c=1, "
        "best batch for c=32), p50 divided by the same factor; assumes everything speeds up like ORT. Not a verdict",
        "server log warnings and errors, per repeat (count, first lines)": problems,
        "server env": {
            **{k: v for k, v in os.environ.items() if k.startswith("SLUICEGATE_SERVING__")},
            "SLUICEGATE_SERVING__ORT_THREADS": "1",
        },
    }
    if busy > NOISE_CORES:
        notes["WARNING"] = f"other processes used {busy:.2f} cores during the run: rerun on a quiet machine"
    return notes


def main() -> None:
    args = parse_args()
    bench: Path = args.bench_dir
    require_harness(bench)
    server_cpu, client_cpu, pin_note = pinning()
    progress(f"pinning: {pin_note}")
    started = cpu_seconds()
    max_batch = {"small": args.small_max_batch, "medium": args.medium_max_batch}
    runs, problems = run_repeats(bench, max_batch, (server_cpu, client_cpu), args)
    repeats = [
        Repeat(
            server_row(lines, OURS, "sluicegate (this run)"),
            server_row(lines, REFERENCE, "grpcio reference (this run)"),
            limit_row(limit_lines),
        )
        for lines, limit_lines in runs
    ]
    ours, reference, limit = (
        median_row([getattr(r, name) for r in repeats]) for name in ("ours", "reference", "limit")
    )
    every = [line for lines, limit_lines in runs for line in lines + limit_lines]
    notes = run_notes(args, pin_note, others_cores(started), max_batch, repeats, every, problems)
    print(markdown(ours, reference, limit, repeats, notes))
    report = {
        "ours": asdict(ours),
        "reference": asdict(reference),
        "limit": asdict(limit),
        "scaled": [asdict(scaled(row, limit)) for row in (ours, reference)],
        "targets": [asdict(t) for t in targets(ours, limit, repeats)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**report, **notes, "lines": every}, indent=2))
    print(f"\nraw result lines: {args.out}")


if __name__ == "__main__":
    main()
