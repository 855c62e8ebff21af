"""How many CPUs this process may use: its CPU affinity, bounded by the cgroup v2 CPU quota (a container's
CPU limit, e.g. Kubernetes ``resources.limits.cpu``), rounded up. ``os.cpu_count()`` answers the host's
cores, which in a pod limited to 2 CPUs of a 64-core node would start 64 workers that share 2 CPUs."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may use, at least 1."""
    count = len(os.sched_getaffinity(0))
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def cgroup_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest ``cpu.max`` quota (in CPUs) of this process's cgroup v2 and its ancestors; None when
    unlimited or without cgroup v2.

    Every ancestor counts: a limit set on the pod's cgroup binds its containers' cgroups below it."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    # cgroup v2 has one line, "0::/path"; with a cgroup namespace (containers) the path is "/".
    path = next((line.split("::", 1)[1] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    folder = cgroup_root / path.lstrip("/")
    tightest: float | None = None
    while True:
        quota = parse_cpu_max(folder / "cpu.max")
        if quota is not None and (tightest is None or quota < tightest):
            tightest = quota
        if folder == cgroup_root or cgroup_root not in folder.parents:
            return tightest
        folder = folder.parent


def parse_cpu_max(path: Path) -> float | None:
    """``cpu.max`` ("QUOTA PERIOD" in microseconds, or "max PERIOD") as CPUs; None: unlimited or unreadable."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or int(period) <= 0:
        return None
    return int(quota) / int(period)
