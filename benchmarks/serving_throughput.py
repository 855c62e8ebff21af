"""Serving throughput: our KServe V2 gRPC server against Triton and KServe, a grpcio reference and the
ONNX Runtime limit, all measured in the same run with the peers' own harness.

Builds the harness's ``small`` (3-conv CNN, [N,3,64,64] -> 4 classes) and ``medium`` (ResNet-18-like,
[N,3,224,224] -> 1000 classes) models with ``bench/make_models.py`` and wraps them into a temporary model
repository (with a drift baseline, so telemetry on runs every monitor). Each repeat then measures, each
server a fresh process on core 1 (``taskset``), loaded from core 0 by the peers' closed-loop client
(``bench/v2load.py``: one grpc.aio channel, C requests in flight, a fixed warm-up then a fixed window),
its answers checked against ORT's first:

- ``limit``: ``bench/ort_limit.py`` (in-process ``session.run`` on core 1, the peers' session settings);
- ``ours``: ``python -m serving`` with default settings (all observability on), ORT one intra-op thread;
- ``ours_telemetry_off``: the same with ``SLUICEGATE_SERVING__TELEMETRY=false`` (small and medium c=32);
- ``reference``: ``benchmarks/reference_server.py``, a minimal grpcio server with a dynamic batcher;
- ``native``: ``benchmarks/native_reference``, the same batcher behind a C++ gRPC front end that calls
  Python once per batch (built once with ``native_reference/build.py``; ``--no-native`` skips it): what a
  faster path than grpcio's Python layer per request reaches, measured like the others, judged by no target;
  ``native_recorded``: the same with every request recorded (``--records``), small and medium c=32;
- ``triton`` and ``kserve``: the peers (``benchmarks/peers.py``; set up once with the harness's
  ``setup_venvs.sh`` when missing);
- the cores points: the small model from several v2load processes at once (one channel would load one of
  our SO_REUSEPORT processes only; 4 x c=8 on a 2-core machine), ours and Triton, on 1 server core, 2
  (on a 2-core machine the server's second core is the client's), and 8 where the machine has 8 cores.

The order of the servers is reversed every other repeat, so none always gets the earlier minutes. Points
are small c=1, small c=32, medium c=32. Each repeat ends with ``--pairs`` interleaved medium pairs: ours
(one server, kept up) and the in-process limit at our medium batch cap, back to back, the order swapped
every pair. Targets (PASS/MISS), each a ratio within a repeat, then the median: small c=32 >= 1.5x Triton
and >= 1.5x KServe and >= 95% of the reference; small c=1 p50 <= KServe's; medium c=32 >= 97% of the limit,
the median over every pair (a repeat's one limit point is minutes away from ours, and ORT's own speed
drifts more than the target's 3% in that time: serving_report.py); observability (on vs off) costs <= 10%
at small and medium c=32 (``observability_overhead.py`` measures that cost more closely: rounds, server
CPU per request).

Durations: 12 s per point after 3 s of warm-up, median of 2 repeats, like the peers; ``--quick`` (4 s /
1 s, one repeat), ``--duration``, ``--warmup``, ``--repeats``, or ``SLUICEGATE_BENCH_SECONDS`` (the
default of ``--duration``, for ``make bench``). Our server's settings pass through from
``SLUICEGATE_SERVING__*``, except ORT_THREADS=1. ``--out FILE`` writes the summary JSON; the raw result
lines and notes always go to ``--raw`` (``bench-results/serving_throughput.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks.native_reference.build import BuildUnavailable
from benchmarks.native_reference.build import build as build_native
from benchmarks.serving_harness import (
    NOISE_CORES,
    CorePins,
    Server,
    binding,
    build_repository,
    check,
    core_pins,
    cpu_seconds,
    default_bench_dir,
    fill_defaults,
    group_pids,
    json_lines,
    log_problems,
    model_files,
    others_cores,
    pinning,
    process_cpu_s,
    progress,
    require_harness,
    revision,
    run_channels,
    run_load,
    running_native,
    running_reference,
    running_server,
)
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
    cores_table,
    limit_row,
    main_table,
    pairs_line,
    server_row,
    summary,
    targets,
    targets_table,
)
from serving.settings import ServingSettings

# Small: a cap of 8 beat 32 by 9% with a lower p99 (FACTS "Serving on grpcio"). Medium: ~35 ms of ORT per
# image, so ORT's throughput hardly depends on the batch; 8 keeps the core busy while a batch stays near
# 0.3 s (1.1 s at 32, and a request waits for its whole batch).
DEFAULT_MAX_BATCH = {"small": 8, "medium": 8}
REFERENCE_MAX_BATCH = 8  # the yardstick stays fixed when ours is tried with other caps
CORE_COUNTS = (1, 2, 8)  # server cores of the cores points, those the machine holds
SPREAD_TRIES = 3  # loads of a cores point until every worker of ours got a connection (see cores_point)
PER_CORE = 16  # the cores points' requests in flight per server core of the largest point (32 at 2 cores)
PAIRS = "ours-medium-pairs"  # the v2load label and log name of the medium pairs' server
DEFAULT_PAIRS = 3  # medium pairs per repeat: 6 over the default 2 repeats, ~100 s a repeat
TELEMETRY_OFF = {"SLUICEGATE_SERVING__TELEMETRY": "false"}
WORKERS_ENV = "SLUICEGATE_SERVING__WORKERS"
Lines = list[dict[str, Any]]
Starter = Callable[[list[str], str], AbstractContextManager[Server]]  # (server taskset prefix, log name)


@dataclass(frozen=True)
class Job:
    """One server to start in a repeat: its key (the v2load label), the loads to run on it, and how to
    start it on a given ``taskset`` prefix under a log file name."""

    key: str
    loads: tuple[tuple[str, str], ...]  # (model, concurrencies) for v2load, e.g. ("small", "1,32")
    start: Starter
    pins: CorePins | None = None  # the server's cores for a cores point (None: the main pinning)
    cores_point: int | None = None  # also (or only) the multi-channel small point, as this many cores


@dataclass(frozen=True)
class Setup:
    """What every repeat uses: the harness, the scratch folder, the repository, pinning and the peers."""

    bench: Path
    work: Path
    repo: Path
    server_cpu: list[str]
    client_cpu: list[str]
    core_pins: dict[int, CorePins]
    peer_root: Path | None  # None: --no-peers
    native_dir: Path | None = None  # the built native front end (None: --no-native, or it could not be built)


def jobs(setup: Setup) -> list[Job]:
    """Every server of one repeat, in the order of even repeats."""
    work, repo = setup.work, setup.repo
    both = (("small", "1,32"), ("medium", "32"))
    one_core = 1 if 1 in setup.core_pins else None
    found = [
        Job(OURS, both, lambda pin, log: running_server(repo, work, pin, log_name=log), cores_point=one_core),
        Job(
            OFF,
            (("small", "32"), ("medium", "32")),
            lambda pin, log: running_server(repo, work, pin, env={**os.environ, **TELEMETRY_OFF}, log_name=log),
        ),
        Job(
            REFERENCE,
            both,
            lambda pin, log: running_reference(model_files(work), work, pin, max_batch=REFERENCE_MAX_BATCH),
        ),
    ]
    if (native_dir := setup.native_dir) is not None:

        def native(records: Path | None) -> Starter:
            return lambda pin, log: running_native(
                model_files(work), work, pin, max_batch=REFERENCE_MAX_BATCH, module_dir=native_dir, records=records
            )

        found += [
            Job(NATIVE, both, native(None)),
            Job(NATIVE_REC, (("small", "32"), ("medium", "32")), native(work / "native-records.jsonl")),
        ]
    if setup.peer_root is not None:
        found += [
            Job(TRITON, both, peer(setup, peers.running_triton, ("small", "medium")), cores_point=one_core),
            Job(KSERVE, both, peer(setup, peers.running_kserve, ("small", "medium"))),
        ]
    for cores, pins in setup.core_pins.items():
        if cores == 1:
            continue
        found.append(Job(f"{OURS}@{cores}", (), ours_on_cores(setup, cores), pins, cores))
        if setup.peer_root is not None:
            found.append(Job(f"{TRITON}@{cores}", (), peer(setup, peers.running_triton, ("small",)), pins, cores))
    return found


def peer(setup: Setup, launcher: Callable[..., AbstractContextManager[Server]], models: tuple[str, ...]) -> Starter:
    """A peer's starter: ``peers.running_triton`` or ``peers.running_kserve`` serving ``models``."""
    root = setup.peer_root
    assert root is not None  # jobs() asks for peers only when they are measured

    def start(pin: list[str], log: str) -> AbstractContextManager[Server]:
        return launcher(root, setup.bench, setup.work / "models", models, setup.work, pin, log)

    return start


def ours_on_cores(setup: Setup, cores: int) -> Starter:
    """Our server with ``cores`` worker processes (``SLUICEGATE_SERVING__WORKERS``, where the server has it)."""
    env = dict(os.environ)
    if "workers" in ServingSettings.model_fields:
        env[WORKERS_ENV] = str(cores)
    return lambda pin, log: running_server(setup.repo, setup.work, pin, env=env, log_name=log)


def run_job(job: Job, setup: Setup, repeat: int, args: argparse.Namespace) -> tuple[Lines, Path]:
    """Start the server, check its loopback binding and answers, run its loads, stop it."""
    server_pin = job.pins.server if job.pins else setup.server_cpu
    log_name = f"{job.key}-{repeat}.log"
    timing = (args.duration, args.warmup)
    lines: Lines = []
    with job.start(server_pin, log_name) as server:
        lines.append(binding(server.pid, job.key))
        for model, concurrency in job.loads:
            progress(f"{job.key} {model}: check, then c={concurrency} for {args.duration:g} s per point...")
            check(setup.client_cpu, setup.bench, setup.work / "models", server.target, model, job.key)
            lines += run_load(setup.client_cpu, setup.bench, server.target, model, concurrency, timing, job.key)
        if job.cores_point is not None:
            lines.append(cores_point(job, setup, server, args))
        log = server.log
    return lines, log


def cores_point(job: Job, setup: Setup, server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """The small model from several v2load processes, with each server process's CPU seconds over the load.

    SO_REUSEPORT hashes each connection to one of our worker processes, so with 2 channels and 2 workers
    both land on one worker half the time, and the point would measure one worker on two cores. When a
    worker did next to nothing (``idle_workers``), the point is loaded again on fresh connections, up to
    ``SPREAD_TRIES`` times in all; ``tries`` in the line says how many it took (the last one is kept)."""
    pins = setup.core_pins[job.cores_point or 1]
    key = job.key.split("@")[0]
    label = f"{key}@{job.cores_point}"
    channels, per_channel = client_plan(setup, args)
    workers = job.cores_point if key == OURS and job.cores_point and job.cores_point > 1 else 1
    if not job.loads:
        check(pins.client, setup.bench, setup.work / "models", server.target, "small", label)
    timing = (args.duration, args.warmup)
    for tries in range(1, SPREAD_TRIES + 1):
        progress(f"{label}: small, {channels} channels x c={per_channel} for {args.duration:g} s (try {tries})...")
        before = group_cpu_s(server.pid)
        line = run_channels(pins.client, setup.bench, server.target, "small", channels, per_channel, timing, label)
        after = group_cpu_s(server.pid)
        used = sorted((round(after[p] - before.get(p, 0.0), 2) for p in after), reverse=True)
        line |= {"server_cpu_s_by_process": used, "tries": tries}
        if not idle_workers(used, workers):
            break
    return line


def idle_workers(used: list[float], workers: int) -> bool:
    """Fewer than ``workers`` server processes did at least a quarter of the busiest one's work (the
    supervisor of our workers does next to nothing and is not counted)."""
    return bool(used) and sum(1 for cpu in used if cpu >= 0.25 * used[0]) < workers


def client_plan(setup: Setup, args: argparse.Namespace) -> tuple[int, int]:
    """v2load processes and requests in flight each, the same for every cores point and server of a run.

    ``PER_CORE`` x the largest core count (at least 2) in flight, from 4 processes per core of the largest
    point beyond 2 cores, else 4: 4 x 8 on a 2-core machine, 32 x 4 for 8 cores. SO_REUSEPORT hashes each connection
    to one process: 2 connections miss one of 2 workers half the time (4 of 6 loads in the first runs),
    4 connections an eighth of the time, and ``cores_point`` loads again when one is missed.
    ``--channels`` overrides."""
    most = max(setup.core_pins, default=1)
    channels = args.channels or (4 if most <= 2 else 4 * most)
    return channels, max(1, PER_CORE * max(2, most) // channels)


def group_cpu_s(pgid: int) -> dict[int, float]:
    found = {}
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            found[pid] = process_cpu_s(pid)
    return found


def ort_limit(setup: Setup, args: argparse.Namespace, models: str = "small,medium", batches: str = "") -> Lines:
    argv = [
        *setup.server_cpu,
        sys.executable,
        str(setup.bench / "ort_limit.py"),
        "--models-dir",
        str(setup.work / "models"),
    ]
    argv += ["--model", models, "--batch", batches or args.ort_batches]
    argv += ["--duration", str(args.duration), "--warmup", str(args.warmup)]
    return json_lines(argv, env={**os.environ, "PEERBENCH_ORT_THREADS": "1"})


def measure_repeat(setup: Setup, repeat: int, args: argparse.Namespace) -> tuple[Lines, dict[str, Any]]:
    """Every server of one repeat, the order reversed in odd repeats; the limit first or last."""
    order: list[Job | None] = [None, *jobs(setup)]  # None: the in-process limit
    if repeat % 2:
        order.reverse()
    lines: Lines = []
    problems: dict[str, Any] = {}
    for job in order:
        if job is None:
            progress("ORT limit (in process)...")
            lines += ort_limit(setup, args)
            continue
        found, log = run_job(job, setup, repeat, args)
        lines += found
        problems[job.key] = log_problems(log)
    if args.pairs:
        found, log = medium_pairs(setup, repeat, args)
        lines += found
        problems[PAIRS] = log_problems(log)
    return lines, problems


def medium_pairs(setup: Setup, repeat: int, args: argparse.Namespace) -> tuple[Lines, Path]:
    """``args.pairs`` pairs of medium c=32 points: ours (one server, idle while the limit runs) and the
    in-process limit at our medium batch cap, back to back, which one goes first swapped every pair. Every
    line gets ``pair``: its pair's index in the run."""
    timing = (args.duration, args.warmup)
    lines: Lines = []
    with running_server(setup.repo, setup.work, setup.server_cpu, log_name=f"{PAIRS}-{repeat}.log") as server:
        lines.append(binding(server.pid, PAIRS))
        check(setup.client_cpu, setup.bench, setup.work / "models", server.target, "medium", PAIRS)
        for k in range(args.pairs):
            index = repeat * args.pairs + k
            progress(f"medium pair {k + 1}/{args.pairs}: ours and the ORT limit, {args.duration:g} s each...")
            steps: list[Callable[[], Lines]] = [
                lambda: run_load(setup.client_cpu, setup.bench, server.target, "medium", "32", timing, PAIRS),
                lambda: ort_limit(setup, args, models="medium", batches=str(args.medium_max_batch)),
            ]
            for step in steps if (index % 2 == 0) else steps[::-1]:
                lines += [{**line, "pair": index} for line in step()]
        log = server.log
    return lines, log


def to_repeat(lines: Lines) -> Repeat:
    repeat = Repeat()
    labels = {x["label"] for x in lines if x["kind"] == "v2grpc"}
    repeat.rows[LIMIT] = limit_row(lines)
    for key in (OURS, REFERENCE, NATIVE, TRITON, KSERVE):
        if key in labels:
            repeat.rows[key] = server_row(lines, key)
    for key in (OFF, NATIVE_REC):
        if key in labels:
            repeat.rows[key] = server_row(lines, key, ("small_c32", "medium_c32"))
    for line in lines:
        if line["kind"] == "v2grpc" and "@" in line["label"]:
            if line["errors"]:
                raise RuntimeError(f"{line['label']}: {line['errors']} errors: {line['first_error']}")
            key, cores = line["label"].split("@")
            repeat.cores.setdefault(key, {})[int(cores)] = Point(float(line["infer_per_s"]), float(line["p50_ms"]))
    repeat.medium_pairs = pairs_of(lines)
    return repeat


def pairs_of(lines: Lines) -> list[tuple[float, float]]:
    """(ours, limit) infer/s of each complete medium pair, in pair order (raise if ours answered with errors)."""
    ours: dict[int, float] = {}
    limit: dict[int, float] = {}
    for line in lines:
        if "pair" not in line:
            continue
        if line["kind"] == "v2grpc":
            if line["errors"]:
                raise RuntimeError(f"medium pair {line['pair']}: {line['errors']} errors: {line['first_error']}")
            ours[line["pair"]] = float(line["infer_per_s"])
        elif line["kind"] == "ort_limit":
            limit[line["pair"]] = float(line["infer_per_s"])
    return [(ours[k], limit[k]) for k in sorted(ours) if k in limit]


def client_cpu(lines: Lines) -> dict[str, float]:
    """The client's largest CPU share per load point (~0.8 and above: the client is the limit)."""
    found: dict[str, float] = {}
    for line in lines:
        if line["kind"] == "v2grpc":
            key = f"{line['label']} {line['model']} c={line['concurrency']}"
            found[key] = max(found.get(key, 0.0), float(line["client_cpu_util"]))
    return found


def cores_notes(setup: Setup, args: argparse.Namespace) -> tuple[str, dict[int, str]]:
    """The cores table's client, and a mark on each core count whose server shares a core with the client."""
    pins = setup.core_pins
    client = next(iter(pins.values())).client_cpus if pins else "-"
    channels, per_channel = client_plan(setup, args)
    header = f"small, {channels} v2load processes x c={per_channel} on core(s) {client}; infer/s (median p50)"
    marks = {n: f" (cores {p.server_cpus}: shares core {client} with the client)" for n, p in pins.items() if p.shared}
    marks |= {n: f" (cores {p.server_cpus})" for n, p in pins.items() if not p.shared}
    return header, marks


def front_end() -> str:
    """Which gRPC front end our server runs on in this run (serving/native where built and not switched off)."""
    setting = os.environ.get("SLUICEGATE_SERVING__NATIVE_FRONT", "auto")
    if setting == "off":
        return "grpcio (NATIVE_FRONT=off)"
    from serving.native import load

    module, why = load()
    return "native (serving/native: C++ lanes, grpcio behind for the rest)" if module else f"grpcio: native {why}"


def run_notes(
    setup: Setup, args: argparse.Namespace, pin_note: str, busy: float, every: Lines, problems: Any, native_note: str
) -> dict[str, Any]:
    """How the run went: durations, pinning, revision, noise, settings, versions, and the servers' logs."""
    workers = "workers" in ServingSettings.model_fields
    notes: dict[str, Any] = {
        "durations": f"{args.duration:g} s per point after {args.warmup:g} s warm-up; median of "
        f"{args.repeats} repeat(s); server order reversed every other repeat; {args.pairs} medium pair(s) "
        "(ours, then the limit, or the other way round) at the end of each repeat",
        "pinning": pin_note,
        "server code": revision(),
        "other processes' CPU during the run": f"{busy:.2f} cores on average",
        "max_batch_size": {
            "ours": {"small": args.small_max_batch, "medium": args.medium_max_batch},
            "grpcio reference": REFERENCE_MAX_BATCH,
            "native reference": REFERENCE_MAX_BATCH,
            "Triton": f"{peers.TRITON_MAX_BATCH} rows, max queue delay {peers.TRITON_MAX_DELAY_US} us",
            "KServe": "no batching",
        },
        "peers": str(setup.peer_root) if setup.peer_root else "not measured (--no-peers)",
        "native reference": native_note,
        "ours: gRPC front end": front_end(),
        "cores points": f"ours with {WORKERS_ENV}=N"
        if workers
        else f"ours: this server has no {WORKERS_ENV} yet, so one process on N cores",
        "cores points per repeat: loads it took, CPU s of each server process over the kept load": {
            label: [
                (x["tries"], x["server_cpu_s_by_process"])
                for x in every
                if x["kind"] == "v2grpc" and x["label"] == label
            ]
            for label in sorted({x["label"] for x in every if x["kind"] == "v2grpc" and "@" in x["label"]})
        },
        "client_cpu_util (max; ~0.8+: client-bound)": client_cpu(every),
        "server log warnings and errors, per repeat (count, first lines)": problems,
        "server env": {
            **{k: v for k, v in os.environ.items() if k.startswith("SLUICEGATE_SERVING__")},
            "SLUICEGATE_SERVING__ORT_THREADS": "1",
        },
    }
    if setup.peer_root is not None:
        notes["peer versions"] = peers.versions(setup.peer_root)
    if busy > NOISE_CORES:
        notes["WARNING"] = f"other processes used {busy:.2f} cores during the run: rerun on a quiet machine"
    return notes


def markdown(repeats: list[Repeat], setup: Setup, args: argparse.Namespace, notes: dict[str, Any]) -> str:
    header, marks = cores_notes(setup, args)
    lines = [*main_table(repeats, TITLES), "", *cores_table(repeats, TITLES, header, marks), ""]
    lines += [*targets_table(targets(repeats)), ""]
    if (spread := pairs_line(repeats)) is not None:
        lines += [f"- {spread}"]
    lines += [f"- {key}: {value}" for key, value in notes.items()]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, help="seconds per point (12 like the peers; --quick: 4)")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up per point (3; --quick: 1)")
    parser.add_argument("--repeats", type=int, help="whole runs, the table shows medians (2; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="shorter defaults for a smoke run (~3 min)")
    parser.add_argument("--bench-dir", type=Path, default=default_bench_dir(), help="the shared harness")
    parser.add_argument(
        "--peer-root",
        type=Path,
        default=peers.default_root(os.environ),
        help="the peers' venvs and models, set up there by setup_venvs.sh when missing "
        f"(default: ${peers.ROOT_ENV[0]}, else ${peers.ROOT_ENV[1]}, else {peers.DEFAULT_ROOT})",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip Triton and KServe (no setup either)")
    parser.add_argument("--no-native", action="store_true", help="skip the native reference (no build either)")
    parser.add_argument(
        "--channels",
        type=int,
        help=f"v2load processes of the cores points (default: 4, and 4 per core of the largest point beyond 2; "
        f"{PER_CORE} in flight per core of the largest point, at least 2, over all)",
    )
    parser.add_argument(
        "--cores",
        default=",".join(map(str, CORE_COUNTS)),
        help="server cores of the cores points (those the machine has)",
    )
    parser.add_argument("--small-max-batch", type=int, default=DEFAULT_MAX_BATCH["small"])
    parser.add_argument("--medium-max-batch", type=int, default=DEFAULT_MAX_BATCH["medium"])
    parser.add_argument("--ort-batches", default="1,8,32", help="batch sizes of the in-process limit")
    parser.add_argument(
        "--pairs",
        type=int,
        help=f"interleaved medium pairs (ours, limit) per repeat, which judge the medium target "
        f"({DEFAULT_PAIRS}; --quick: 1; 0: none, the repeat's ratio judges it)",
    )
    parser.add_argument("--out", type=Path, help="write the summary JSON here")
    parser.add_argument("--raw", type=Path, default=Path("bench-results/serving_throughput.json"))
    quick = {"duration": 4.0, "warmup": 1.0, "repeats": 1, "pairs": 1}
    defaults = {"duration": 12.0, "warmup": 3.0, "repeats": 2, "pairs": DEFAULT_PAIRS}
    return fill_defaults(parser.parse_args(), quick, defaults)


def native_front(args: argparse.Namespace, peer_root: Path | None) -> tuple[Path | None, str]:
    """The native reference's module folder (built once, cached beside the peers) and a note for the report;
    None where it is skipped or cannot be built here (the run goes on without it and says why)."""
    if args.no_native:
        return None, "not measured (--no-native)"
    cache = (peer_root or peers.default_root(os.environ)) / "native"
    progress(f"native reference: building (cached under {cache})...")
    try:
        built = build_native(cache)
    except BuildUnavailable as exc:
        progress(f"native reference: not measured: {exc}")
        return None, f"not measured: {exc}"
    return built, f"C++ front end built in {built}"


@contextlib.contextmanager
def scratch(bench: Path, args: argparse.Namespace) -> Iterator[tuple[Path, Path]]:
    """A scratch folder with the models and our repository, removed after."""
    work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-serving-"))
    try:
        max_batch = {"small": args.small_max_batch, "medium": args.medium_max_batch}
        yield work, build_repository(bench, work, max_batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    args = parse_args()
    bench: Path = args.bench_dir
    require_harness(bench)
    peer_root = None if args.no_peers else args.peer_root
    if peer_root is not None:
        peers.ensure_peers(bench, peer_root)
    native_dir, native_note = native_front(args, peer_root)
    server_cpu, client, pin_note = pinning()
    progress(f"pinning: {pin_note}")
    held = len(os.sched_getaffinity(0))
    counts = [n for n in (int(c) for c in args.cores.split(",") if c) if n <= held]  # 8: only where it fits
    pins = {n: p for n in counts if (p := core_pins(n, max(counts))) is not None}
    started = cpu_seconds()
    runs, problems = [], []
    with scratch(bench, args) as (work, repo):
        setup = Setup(bench, work, repo, server_cpu, client, pins, peer_root, native_dir)
        for repeat in range(args.repeats):
            progress(f"repeat {repeat + 1}/{args.repeats}")
            lines, found = measure_repeat(setup, repeat, args)
            runs.append(lines)
            problems.append(found)
    repeats = [to_repeat(lines) for lines in runs]
    every = [line for lines in runs for line in lines]
    notes = run_notes(setup, args, pin_note, others_cores(started), every, problems, native_note)
    print(markdown(repeats, setup, args, notes))
    report = summary(repeats)
    raw = {**report, "targets": [asdict(t) for t in targets(repeats)], "repeats": [asdict(r) for r in repeats], **notes}
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    args.raw.write_text(json.dumps({**raw, "lines": every}, indent=2))
    print(f"\nraw result lines: {args.raw}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"summary: {args.out}")


if __name__ == "__main__":
    main()
