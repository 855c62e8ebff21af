"""The server's CPU scheduling policy (serving/scheduling.py): every thread gets it, those already
running included, and those started later inherit it; read back from the kernel, in a process of its own
so the test runner's threads keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.serving.process import ROOT

SCRIPT = """
import json, os, threading
from serving.scheduling import apply_cpu_policy, thread_policies

stop = threading.Event()
before = threading.Thread(target=stop.wait, daemon=True)
before.start()  # running before the policy is chosen, like the allocator's trimmer
report = {"start": sorted(set(thread_policies().values()))}
for policy in ("batch", "normal"):
    changed = apply_cpu_policy(policy)
    after = threading.Thread(target=stop.wait, daemon=True)
    after.start()  # started later: inherits it
    policies = thread_policies()
    report[policy] = {"changed": changed, "threads": len(policies), "policies": sorted(set(policies.values()))}
print(json.dumps(report))
"""


def test_every_thread_takes_the_policy_and_new_threads_inherit_it() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["start"] == [os.SCHED_OTHER]
    assert report["batch"]["policies"] == [os.SCHED_BATCH]
    assert report["batch"]["changed"] >= 2  # the main thread and the one already running
    assert report["batch"]["threads"] == report["batch"]["changed"] + 1  # and the one started after
    assert report["normal"]["policies"] == [os.SCHED_OTHER]  # and back: no privilege needed either way
