"""The CPU scheduling policy of the server's threads (setting ``cpu_policy``).

Linux's default policy (SCHED_OTHER) lets a thread that wakes up preempt the one running when it has
waited longer: every time a gRPC poller, the telemetry thread or the batcher's timer wakes, it takes the
core from the thread inside ONNX Runtime's kernels and hands it back a few microseconds later with cold
caches. With the server on one core at medium c=32 that is about 230 preemptions per second of the
inference thread. SCHED_BATCH ("this is a throughput task") keeps the same fair share and nice levels but
does not preempt on wake-up: the woken thread runs when the running one blocks or its slice ends (a few
milliseconds at most; a small-model batch blocks long before that). Same load: about 37 per second.

Measured (benchmarks/README.md, "CPU policy"), rounds interleaved, server on one core: small c=32 +10%
throughput (higher in 6 of 6 rounds), medium c=32 unchanged (94.6% vs 94.9% of ONNX Runtime's own limit
over 8 rounds of 20 s: its 175 ms kernels are long enough that the wake-ups cost little either way). No
privilege is needed to choose it (unlike the real-time policies) and threads started later inherit it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

CpuPolicy = Literal["batch", "normal"]

_POLICIES = {"batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}


def apply_cpu_policy(policy: CpuPolicy, tasks: Path = Path("/proc/self/task")) -> int:
    """Give every thread of this process ``policy`` (new threads inherit it); the number of threads changed.

    Threads started before this call (the allocator's trimmer, the log flusher) are changed too, by thread
    id. Where the platform has no such policy (not Linux) or the kernel refuses, it logs why and the
    server runs on the default policy: this is a speed setting, never a reason not to serve."""
    name = _POLICIES[policy]
    number = getattr(os, name, None)
    if number is None or not hasattr(os, "sched_setscheduler"):
        log.warning("cpu_policy %s: this platform has no %s; running with the default policy", policy, name)
        return 0
    try:
        tids = [int(entry.name) for entry in tasks.iterdir()]
    except OSError:
        tids = [0]  # no /proc: the calling thread, which is the one that starts the others
    changed = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, number, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that ended since the listing
        except OSError as err:
            log.warning("cpu_policy %s: the kernel refused %s (%s); running with the default policy", policy, name, err)
            return changed
        changed += 1
    log.info("cpu_policy %s: %s on %d thread(s) and the threads they start", policy, name, changed)
    return changed


def thread_policies(tasks: Path = Path("/proc/self/task")) -> dict[int, int]:
    """The scheduling policy (``os.SCHED_*``) of each thread of this process, by thread id."""
    policies = {}
    for entry in tasks.iterdir():
        try:
            policies[int(entry.name)] = os.sched_getscheduler(int(entry.name))
        except ProcessLookupError:
            continue
    return policies
