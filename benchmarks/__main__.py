"""`python -m benchmarks`: every benchmark in turn (what `make bench` runs), each with its full defaults.

Each runs in its own interpreter (`python -m benchmarks.<name>`, no flags), so one that fails does not
stop the others, and no state leaks from one into the next; the end prints each one's wall time and exit
status, and the exit status is 1 if any failed. `python -m benchmarks NAME...` runs only those (e.g.
`serving_throughput`). Set `SLUICEGATE_BENCH_SECONDS` to shorten the serving benchmarks' points.
"""

from __future__ import annotations

import subprocess
import sys
import time

BENCHMARKS = (
    "benchmarks.event_latency",
    "benchmarks.data_gate_throughput",
    "benchmarks.training_throughput",
    "benchmarks.real_datasets",
    "benchmarks.serving_throughput",  # sets up the peers (Triton, KServe) on first use: see its README section
    "benchmarks.observability_overhead",
    "benchmarks.rollout_time",
    "benchmarks.demo_time",
)


def chosen(names: list[str]) -> list[str]:
    if not names:
        return list(BENCHMARKS)
    wanted = [name if name.startswith("benchmarks.") else f"benchmarks.{name}" for name in names]
    unknown = sorted(set(wanted) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; choose from {[b.split('.')[1] for b in BENCHMARKS]}")
    return wanted


def main() -> int:
    results = []
    for name in chosen(sys.argv[1:]):
        print(f"\n=== {name} ===", flush=True)
        start = time.monotonic()
        code = subprocess.run([sys.executable, "-m", name], check=False).returncode
        results.append((name, time.monotonic() - start, code))
    print("\n| benchmark | wall time | exit |\n|---|---:|---:|")
    for name, seconds, code in results:
        print(f"| {name} | {seconds / 60:.1f} min | {code} |")
    print(f"| total | {sum(s for _, s, _ in results) / 60:.1f} min | |", flush=True)
    return 1 if any(code for _, _, code in results) else 0


if __name__ == "__main__":
    sys.exit(main())
