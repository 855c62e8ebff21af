"""Rollout time: a full local canary with the default plan shortened to seconds, and how fast a fault is
rolled back (issue 8).

Each repeat serves a fresh repository with ``python -m serving`` on core 1 (the serving benchmarks'
pinning; the admin token in ``SLUICEGATE_SERVING__ADMIN_TOKEN``) and runs, from this process on core 0:

- a steady client: ``--threads`` threads sending single ``small`` requests without a version (routed by
  the traffic weights, as production traffic is), paced to ``--rate`` requests/s in all, one request in
  flight per thread (closed loop: a slow answer delays that thread's next request), counting failures
  and which version answered;
- a watcher polling the server's traffic route (``GET /v2/models/small/traffic``, admin token) every
  50 ms, recording every change of the weights;
- ``run_rollout`` with the local platform and the scrape metrics source, twice: the good canary (version
  2, a copy of the stable version 1) through every step to its promotion, then the faulty canary
  (version 3) against the new stable 2.

The models are the harness's ``small`` ONNX model (``make_models.py`` via ``build_repository``), written
as versions 1, 2 and 3 with ``serving.model_format``. The fault is injected latency that costs no CPU:
version 3 is the same model with a batching ``max_queue_delay_us`` of 40,000, so every lone request
waits 40 ms for company (a real misconfiguration) while the two cores stay as loaded as before.

The plan is the default one (steps 5, 20, 50, 100) with ``hold_s`` 3, ``analysis_interval_s`` 1 and
``min_requests`` 30, and latency bounds looser than production's (``rollout_plan`` says why).

Measured per repeat: the full canary time (``run_rollout`` call to its promoted outcome: loading the
canary, three held steps, the promotion and the retirement of the old version), each step's ``held_s``
(from setting its weight to the read that passed it), and the client's failed requests during each
rollout (target: 0). Rollback reaction of the fault, two ways: ``Outcome.detected_after_s`` (from the
runner setting the 5% weight to the rollback's return) and, independently, the watcher's time from the
faulty version's weight first > 0 to its weight back at 0 (stable at 100%). Target: reaction <=
``analysis_interval_s`` + 5 s, median and max over repeats. The client's view (first to last answer by
the faulty version) is information.

    .venv/bin/python -m benchmarks.rollout_time              # 3 repeats (~1 min)
    .venv/bin/python -m benchmarks.rollout_time --quick      # 1 repeat (~25 s)
    .venv/bin/python -m benchmarks.rollout_time --hold 10 --interval 2 --rate 200
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc as triton

from benchmarks.serving_harness import (
    CLIENT_CPU,
    NOISE_CORES,
    SHAPES,
    Server,
    build_repository,
    cpu_seconds,
    default_bench_dir,
    log_problems,
    others_cores,
    pinning,
    progress,
    revision,
    running_server,
)
from serving.model_format import read_config, write_version
from tasks.rollout.local import LocalPlatform
from tasks.rollout.metrics import ScrapeSource
from tasks.rollout.plan import CustomCheck, RolloutPlan, Thresholds, VersionMetrics
from tasks.rollout.runner import Hooks, run_rollout

MODEL = "small"
STABLE, GOOD, FAULT = "1", "2", "3"
FAULT_DELAY_US = 40_000  # every lone request to the faulty version waits 40 ms for a batch to form
TOKEN = "rollout-time-bench-token"
MAX_BATCH = {"small": 8, "medium": 8}  # serving_throughput.py's defaults
POLL_S = 0.05
REACTION_SLACK_S = 5.0  # the target: back to stable within one analysis interval + 5 s
CONTROLLED = ("SLUICEGATE_SERVING__ADMIN_TOKEN", "SLUICEGATE_SERVING__MAX_QUEUE_DELAY_US")


def stage_versions(bench: Path, work: Path) -> Path:
    """The small model as versions 1 (stable), 2 (good canary) and 3 (40 ms batching delay) in ``work/staging``."""
    built = build_repository(bench, work, MAX_BATCH)
    config = read_config(built / MODEL / "1")
    onnx = {config.model_file: built / MODEL / "1" / config.model_file}
    staging = work / "staging"
    for version, delay_us in ((STABLE, 0), (GOOD, 0), (FAULT, FAULT_DELAY_US)):
        batching = {**config.batching, "max_queue_delay_us": delay_us}
        write_version(staging, dataclasses.replace(config, version=version, batching=batching), onnx)
    return staging


def rollout_plan(args: argparse.Namespace) -> RolloutPlan:
    # Looser latency bounds than production's (+10%, 2 ms): the server, this client and both versions
    # share two cores, so two equal models' p95s over a few dozen requests differ by several ms. The
    # fault adds 40 ms, far outside +50% / 10 ms.
    thresholds = Thresholds(max_p95_increase=0.5, min_p95_delta_s=0.010)
    return RolloutPlan(
        hold_s=args.hold,
        analysis_interval_s=args.interval,
        min_requests=args.min_requests,
        max_inconclusive=5,
        thresholds=thresholds,
    )


@dataclass
class SteadyClient:
    """Threads sending single requests without a version at a paced rate, one in flight per thread."""

    target: str
    input_name: str
    threads: int
    rate: float  # requests/s over all threads
    answers: list[tuple[float, str | None]] = field(default_factory=list)  # (time, version; None: failed)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _running: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for seed in range(self.threads):
            thread = threading.Thread(target=self._run, args=(seed,), name=f"client-{seed}", daemon=True)
            thread.start()
            self._running.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._running:
            thread.join(30)

    def between(self, start: float, end: float) -> list[str | None]:
        return [version for at, version in list(self.answers) if start <= at <= end]

    def _run(self, seed: int) -> None:
        client = triton.InferenceServerClient(self.target)
        x = np.random.default_rng(seed).normal(size=(1, *SHAPES[MODEL])).astype(np.float32)
        given = triton.InferInput(self.input_name, list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        period = self.threads / self.rate
        due = time.monotonic() + period * seed / self.threads  # threads spread over one period
        while not self._stop.is_set():
            self._stop.wait(max(0.0, due - time.monotonic()))
            due = max(due + period, time.monotonic() - period)  # behind: no burst to catch up
            try:
                answer = client.infer(MODEL, [given], client_timeout=30)
                self.answers.append((time.monotonic(), answer.get_response().model_version))
            except Exception as exc:  # every failure is what is counted here
                self.answers.append((time.monotonic(), None))
                self.errors.append(str(exc)[:300])
        client.close()


@dataclass
class WeightWatcher:
    """Polls the traffic route every ``POLL_S`` and keeps each change of the weights, with its time."""

    url: str
    changes: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def reaction(self, version: str, since: float) -> tuple[float, float] | None:
        """When ``version`` first had a positive weight after ``since``, and when it was back at 0."""
        exposed = None
        for at, weights in list(self.changes):
            if at < since:
                continue
            positive = weights.get(version, 0) > 0
            if exposed is None and positive:
                exposed = at
            elif exposed is not None and not positive:
                return exposed, at
        return None

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(headers=headers, timeout=5) as http:
            while not self._stop.wait(POLL_S):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    response = http.get(self.url)
                    weights = dict(response.json().get("weights", {})) if response.status_code == 200 else {}
                    if not self.changes or self.changes[-1][1] != weights:
                        self.changes.append((time.monotonic(), weights))


@dataclass
class TimedSource:
    """The scrape source, timing each of its calls (a read scrapes and parses the whole /metrics page)."""

    inner: ScrapeSource
    calls_s: list[float] = field(default_factory=list)

    def begin(self, model: str) -> Any:
        started = time.monotonic()
        try:
            return self.inner.begin(model)
        finally:
            self.calls_s.append(time.monotonic() - started)

    def read(self, model: str, version: str, since: Any, checks: Sequence[CustomCheck] = ()) -> VersionMetrics:
        started = time.monotonic()
        try:
            return self.inner.read(model, version, since, checks)
        finally:
            self.calls_s.append(time.monotonic() - started)


@dataclass(frozen=True)
class Sample:
    """One rollout in one repeat."""

    repeat: int
    canary: str  # "good" or "fault"
    version: str
    status: str
    reason: str
    total_s: float  # run_rollout call to return
    held_s: dict[int, float]  # canary weight -> seconds from setting it to its last read
    loading_s: float | None  # start -> the first step's weight set (fetch, load, wait ready, weights)
    promoting_s: float | None  # the last read -> promoted (weights, state file, retire the old stable)
    detected_after_s: float | None  # the runner's: setting the failing step's weight -> rollback done
    rollback_s: float | None  # of which the rollback call (after the failing read)
    watched_reaction_s: float | None  # the watcher's: weight first > 0 -> back to 0
    client_exposure_s: float | None  # the client's: first -> last answer by this version
    requests: int  # the client's answers during the rollout
    failures: int
    canary_answers: int
    client_rate: float  # answers/s during the rollout
    metrics_call_s: float  # median of the source's begin/read calls (one /metrics scrape each)
    reads: list[dict[str, Any]]  # every analysis read (hooks.on_step), with its time since the start


def roll(
    repeat: int,
    canary: str,
    version: str,
    platform: LocalPlatform,
    plan: RolloutPlan,
    io: tuple[TimedSource, SteadyClient, WeightWatcher],
) -> Sample:
    """One rollout of ``version`` while the client and the watcher run; what it took."""
    source, client, watcher = io
    reads: list[dict[str, Any]] = []
    source.calls_s.clear()
    started = time.monotonic()

    def on_step(row: dict[str, Any]) -> None:
        kept = ("canary_weight", "decision", "held_s", "canary_requests", "canary_p95_s", "stable_p95_s", "reasons")
        reads.append({"at_s": round(time.monotonic() - started, 3), **{key: row[key] for key in kept}})

    hooks = Hooks(on_step=on_step)
    outcome = run_rollout(MODEL, version, platform=platform, source=source, plan=plan, hooks=hooks)
    ended = time.monotonic()
    time.sleep(0.5)  # the requests in flight at the end, and the watcher's last poll
    answers = client.between(started, ended + 0.5)
    served = [at for at, answered in list(client.answers) if answered == version and at >= started]
    reacted = watcher.reaction(version, started) if canary == "fault" else None
    detected = outcome.detected_after_s
    return Sample(
        repeat=repeat,
        canary=canary,
        version=version,
        status=outcome.status,
        reason=outcome.reason,
        total_s=round(ended - started, 3),
        held_s={int(read["canary_weight"]): float(read["held_s"]) for read in reads},  # each step's last read
        loading_s=round(reads[0]["at_s"] - reads[0]["held_s"], 3) if reads else None,
        promoting_s=round(ended - started - reads[-1]["at_s"], 3) if reads and outcome.status == "promoted" else None,
        detected_after_s=None if detected is None else round(detected, 3),
        rollback_s=None if detected is None or not reads else round(detected - reads[-1]["held_s"], 3),
        watched_reaction_s=None if reacted is None else round(reacted[1] - reacted[0], 3),
        client_exposure_s=round(max(served) - min(served), 3) if served and canary == "fault" else None,
        requests=len(answers),
        failures=sum(1 for answered in answers if answered is None),
        canary_answers=sum(1 for answered in answers if answered == version),
        client_rate=round(len(answers) / (ended + 0.5 - started), 1),
        metrics_call_s=round(statistics.median(source.calls_s), 3) if source.calls_s else float("nan"),
        reads=reads,
    )


@contextlib.contextmanager
def traffic(server: Server, input_name: str, args: argparse.Namespace) -> Iterator[tuple[SteadyClient, WeightWatcher]]:
    client = SteadyClient(server.target, input_name, args.threads, args.rate)
    watcher = WeightWatcher(f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/traffic")
    client.start()
    watcher.start()
    try:
        yield client, watcher
    finally:
        client.stop()
        watcher.stop()


def measure_repeat(
    repeat: int, staging: Path, work: Path, server_cpu: list[str], args: argparse.Namespace
) -> tuple[list[Sample], SteadyClient, tuple[int, list[str]]]:
    """A fresh repository and server holding version 1; the good canary, then the faulty one."""
    repo = work / f"repo-{repeat}"
    shutil.copytree(staging / MODEL / STABLE, repo / MODEL / STABLE)

    def fetch(model: str, version: str, target: Path) -> None:
        shutil.copytree(staging / model / version, target)

    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED} | {"SLUICEGATE_SERVING__ADMIN_TOKEN": TOKEN}
    input_name = read_config(staging / MODEL / STABLE).inputs[0]["name"]
    with running_server(repo, work, server_cpu, env=env, log_name=f"server-{repeat}.log") as server:
        http = f"http://127.0.0.1:{server.http_port}"
        platform = LocalPlatform(repo, server.target, http, TOKEN, fetch=fetch)
        platform.adopt(MODEL, STABLE)
        source, plan = TimedSource(ScrapeSource([f"{http}/metrics"])), rollout_plan(args)
        with traffic(server, input_name, args) as (client, watcher):
            time.sleep(args.warmup)  # traffic before the canary starts, as in production
            progress(f"repeat {repeat + 1}: good canary {GOOD} through {list(plan.steps)}...")
            good = roll(repeat, "good", GOOD, platform, plan, (source, client, watcher))
            progress(f"repeat {repeat + 1}: {good.status} in {good.total_s:.1f} s; faulty canary {FAULT}...")
            fault = roll(repeat, "fault", FAULT, platform, plan, (source, client, watcher))
            progress(f"repeat {repeat + 1}: {fault.status}, detected after {fault.detected_after_s} s")
    return [good, fault], client, log_problems(server.log)


@dataclass
class Table:
    """The result table: one line per measure, median and max over the rollouts, target and verdict."""

    lines: list[str] = field(
        default_factory=lambda: ["| what | median | max | target | verdict |", "|---|---:|---:|---|---|"]
    )

    def row(
        self, what: str, values: Sequence[float | None], target: str = "(information)", limit: float | None = None
    ) -> None:
        """Median and max (– when a rollout has no value); PASS when the max is within ``limit``."""
        known = [v for v in values if v is not None]
        if not known or len(known) < len(values):
            self.lines.append(f"| {what} | – | – | {target} | {'–' if limit is None else 'MISS'} |")
            return
        verdict = "–" if limit is None else ("PASS" if max(known) <= limit else "MISS")
        self.lines.append(f"| {what} | {statistics.median(known):.2f} | {max(known):.2f} | {target} | {verdict} |")

    def count(self, what: str, passed: int, of: int) -> None:
        self.lines.append(f"| {what} | {passed} / {of} | | every repeat | {'PASS' if passed == of else 'MISS'} |")


def canary_rows(table: Table, good: list[Sample], plan: RolloutPlan) -> None:
    floor = plan.hold_s * len(plan.analysed_steps)
    table.count("good canary promoted", sum(s.status == "promoted" for s in good), len(good))
    table.row("full canary, s (start → promoted)", [s.total_s for s in good], f"(information; holds alone {floor:g} s)")
    table.row(f"of which loading the canary, s (start → {plan.steps[0]}% set)", [s.loading_s for s in good])
    for weight in plan.analysed_steps:
        held = [s.held_s.get(weight) for s in good]
        table.row(f"step {weight}%: held_s (weight set → passing read)", held, f"(information; hold {plan.hold_s:g} s)")
    table.row("of which the promotion, s (last read → promoted)", [s.promoting_s for s in good])


def fault_rows(table: Table, fault: list[Sample], plan: RolloutPlan) -> None:
    bound = plan.analysis_interval_s + REACTION_SLACK_S
    first = f"({plan.steps[0]}%)"  # the runner's reason names the failing step: "step 0 (5%) failed: ..."
    table.count(f"faulty canary rolled back at {first[1:-1]}", sum(first in s.reason for s in fault), len(fault))
    detected = [s.detected_after_s for s in fault]
    table.row("rollback reaction, s (runner: detected_after_s)", detected, f"≤ {bound:g} s", bound)
    watched = [s.watched_reaction_s for s in fault]
    table.row("rollback reaction, s (watcher: weight > 0 → 0)", watched, f"≤ {bound:g} s", bound)
    table.row("of which the rollback call, s (after the failing read)", [s.rollback_s for s in fault])
    table.row("client saw the faulty version, s (first → last answer)", [s.client_exposure_s for s in fault])


def markdown(samples: list[Sample], plan: RolloutPlan, notes: dict[str, Any]) -> str:
    table = Table()
    canary_rows(table, [s for s in samples if s.canary == "good"], plan)
    fault_rows(table, [s for s in samples if s.canary == "fault"], plan)
    table.row("one metrics call, s (a /metrics scrape; 2 per read)", [s.metrics_call_s for s in samples])
    failures = [s.failures for s in samples]
    verdict = "PASS" if max(failures) == 0 else "MISS"
    table.lines.append(
        f"| client failures per rollout | {statistics.median(failures):g} | {max(failures)} | 0 | {verdict} |"
    )
    return "\n".join([*table.lines, "", *(f"- {key}: {value}" for key, value in notes.items())])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, help="fresh server, good then faulty canary, each time (3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="1 repeat: a smoke run")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds each step is held (plan hold_s)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads (plan analysis_interval_s)")
    parser.add_argument("--min-requests", type=int, default=30, help="canary requests a step needs to pass")
    parser.add_argument("--rate", type=float, default=300.0, help="the client's requests/s over all its threads")
    parser.add_argument("--threads", type=int, default=4, help="client threads (one request in flight each)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of traffic before the first canary")
    parser.add_argument("--bench-dir", type=Path, default=default_bench_dir(), help="the shared harness")
    parser.add_argument("--out", type=Path, default=Path("bench-results/rollout_time.json"))
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


@contextlib.contextmanager
def pinned_to_client_core(server_cpu: list[str]) -> Iterator[None]:
    """This process (client, watcher, runner) on the client core while the server is pinned to its own."""
    before = os.sched_getaffinity(0)
    if server_cpu:
        os.sched_setaffinity(0, {CLIENT_CPU})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main() -> None:
    args = parse_args()
    if not (args.bench_dir / "make_models.py").is_file():
        raise SystemExit(f"no harness at {args.bench_dir}: pass --bench-dir DIR (the folder with make_models.py)")
    server_cpu, _, pin_note = pinning()
    if server_cpu:
        pin_note += f"; this process (client, watcher, runner) on core {CLIENT_CPU} (sched_setaffinity)"
    progress(f"pinning: {pin_note}")
    plan = rollout_plan(args)
    started = cpu_seconds()
    work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-rollout-"))
    samples: list[Sample] = []
    problems: dict[str, tuple[int, list[str]]] = {}
    errors: list[str] = []
    try:
        staging = stage_versions(args.bench_dir, work)
        with pinned_to_client_core(server_cpu):
            for repeat in range(args.repeats):
                found, client, problems[f"r{repeat + 1}"] = measure_repeat(repeat, staging, work, server_cpu, args)
                samples += found
                errors += client.errors[:3]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    busy = others_cores(started)
    notes = report_notes(samples, plan, args, pin_note, busy, problems, errors)
    print(markdown(samples, plan, notes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"samples": [asdict(s) for s in samples], **notes}, indent=2, default=str))
    print(f"\nraw result lines: {args.out}")


def report_notes(
    samples: list[Sample],
    plan: RolloutPlan,
    args: argparse.Namespace,
    pin_note: str,
    busy: float,
    problems: dict[str, tuple[int, list[str]]],
    errors: list[str],
) -> dict[str, Any]:
    first = plan.steps[0]
    at_first = [[r["canary_requests"] for r in s.reads if r["canary_weight"] == first] for s in samples]
    notes: dict[str, Any] = {
        "plan": f"steps {list(plan.steps)}, hold {plan.hold_s:g} s, analysis every {plan.analysis_interval_s:g} s, "
        f"min {plan.min_requests} canary requests, latency bound +{plan.thresholds.max_p95_increase:.0%} "
        f"and > {plan.thresholds.min_p95_delta_s * 1e3:g} ms",
        "fault": f"version {FAULT}: the same model with max_queue_delay_us {FAULT_DELAY_US:,} (40 ms per lone request)",
        "client": f"{args.threads} threads paced to {args.rate:g} requests/s, one in flight each; measured "
        f"{statistics.median(s.client_rate for s in samples):.0f} requests/s (median over rollouts)",
        f"canary requests at the {first}% step's passing (or failing) read, per rollout": [
            c[-1] for c in at_first if c
        ],
        "repeats": f"{args.repeats} (fresh repository and server each)",
        "pinning": pin_note,
        "watcher": f"the traffic route polled every {POLL_S * 1e3:.0f} ms (reaction resolution ±{POLL_S * 1e3:.0f} ms)",
        "server code": revision(),
        "other processes' CPU during the run": f"{busy:.2f} cores on average",
        "server log warnings and errors (count, first lines)": {k: v for k, v in problems.items() if v[0]},
        "client errors (first)": errors[:5],
    }
    if busy > NOISE_CORES:
        notes["WARNING"] = f"other processes used {busy:.2f} cores during the run: rerun on a quiet machine"
    return notes


if __name__ == "__main__":
    main()
