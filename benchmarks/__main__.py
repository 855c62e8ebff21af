"""`python -m benchmarks`: every benchmark in turn (what `make bench` runs)."""

import runpy
import sys

BENCHMARKS = (
    "benchmarks.event_latency",
    "benchmarks.data_gate_throughput",
    "benchmarks.training_throughput",
    "benchmarks.real_datasets",
    "benchmarks.serving_throughput",
    "benchmarks.observability_overhead",
    "benchmarks.rollout_time",
    "benchmarks.demo_time",
)

if __name__ == "__main__":
    for name in BENCHMARKS:
        print(f"\n=== {name} ===", flush=True)
        sys.argv = [name]
        runpy.run_module(name, run_name="__main__")
