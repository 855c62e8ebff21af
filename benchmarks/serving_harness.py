"""What the serving benchmarks share: the bench models as a model repository, servers started and always
stopped, the peers' load client, CPU accounting.

Servers run pinned to core 1 and the client to core 0 (``taskset``), each server in its own process
group, stopped with SIGTERM to the group and SIGKILL after ``STOP_GRACE_S``. The load client and the
models are the shared harness's (``shared/bench``: ``v2load.py``, ``make_models.py``, ``ort_limit.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serving.model_format import ModelConfig, write_version
from serving.preprocessing import PreprocessSpec

ROOT = Path(__file__).resolve().parents[1]
SERVER_CPU, CLIENT_CPU = 1, 0
MODELS = ("small", "medium")
SHAPES = {"small": (3, 64, 64), "medium": (3, 224, 224)}
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 15.0
NOISE_CORES = 0.1  # other processes' average CPU above which a run is flagged as disturbed
BASELINE_IMAGES = 1000
# Server log lines worth reporting: WARNING and above in our JSON log (a failed request's log line is a
# WARNING) and in the reference's plain one, and tracebacks.
PROBLEM = re.compile(r'"level": ?"(WARNING|ERROR|CRITICAL)"| (WARNING|ERROR|CRITICAL) |Traceback \(most recent')


@dataclass(frozen=True)
class Server:
    """A started server: its pid (taskset execs, so the pid is the server's), gRPC port and log file."""

    pid: int
    grpc_port: int
    log: Path
    http_port: int | None = None  # ours only: health and /metrics

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_bench_dir() -> Path:
    for candidate in (ROOT / "shared" / "bench", ROOT.parent / "shared" / "bench"):
        if (candidate / "v2load.py").is_file():
            return candidate
    return ROOT.parent / "shared" / "bench"


def pinning() -> tuple[list[str], list[str], str]:
    """``taskset`` prefixes for the server and the client, and a note when they cannot be pinned."""
    if shutil.which("taskset") is None:
        return [], [], "taskset not found: server and client NOT pinned (numbers not comparable with the peers)"
    if not {SERVER_CPU, CLIENT_CPU} <= os.sched_getaffinity(0):
        return [], [], f"cores {CLIENT_CPU} and {SERVER_CPU} not both available: NOT pinned"
    note = f"server on core {SERVER_CPU}, client on core {CLIENT_CPU} (taskset)"
    return ["taskset", "-c", str(SERVER_CPU)], ["taskset", "-c", str(CLIENT_CPU)], note


def cpu_seconds() -> tuple[float, float, float]:
    """Wall clock, CPU busy on the whole machine (/proc/stat) and CPU used by us and our waited children."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, _steal = fields
    machine = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    ours = sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    return time.monotonic(), machine, ours


def others_cores(start: tuple[float, float, float]) -> float:
    """Cores used on average since ``start`` by processes that are not this benchmark's (approximate: softirq
    time of our own loopback traffic counts as theirs)."""
    end = cpu_seconds()
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def process_cpu_s(pid: int) -> float:
    """utime + stime of a live process, all its threads, in seconds (/proc/PID/stat fields 14 and 15)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def json_lines(argv: list[str], env: Mapping[str, str] | None = None, timeout: float = 900) -> list[dict[str, Any]]:
    """Run a harness script and parse its JSON result lines; raise with its stderr if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def drift_baseline(images: int = BASELINE_IMAGES, seed: int = 0) -> dict[str, list[float]]:
    """Per-image RGB channel means (0..255) of synthetic photos, in ``channel_baseline``'s format.

    Each image gets a scene brightness and a colour cast (warm on average, like ImageNet's channel means
    124/116/104) plus per-pixel texture, clipped to uint8, so the means spread like a real dataset's
    (tens of grey levels), not like noise around one value. What matters here is that the server builds a
    drift monitor and feeds it every request; v2load's random inputs will drift from it, which is fine.
    """
    rng = np.random.default_rng(seed)
    brightness = rng.normal(115.0, 30.0, size=(images, 1, 1))
    cast = rng.normal((8.0, 0.0, -12.0), 10.0, size=(images, 1, 3))
    texture = rng.normal(0.0, 45.0, size=(images, 32 * 32, 3))
    pixels = np.clip(np.rint(brightness + cast + texture), 0, 255)
    means = pixels.mean(axis=1)
    return {channel: [round(float(v), 3) for v in means[:, index]] for index, channel in enumerate("rgb")}


def build_repository(bench: Path, work: Path, max_batch: Mapping[str, int]) -> Path:
    """``make_models.py`` into ``work/models``, then each model as version 1 of ``work/repo`` (with a drift
    baseline, so telemetry on means the drift monitor runs too)."""
    models = work / "models"
    json_lines([sys.executable, str(bench / "make_models.py"), str(models)])
    meta = json.loads((models / "models.json").read_text())
    repo = work / "repo"
    baseline = drift_baseline()
    for name in MODELS:
        shape, classes = meta[name]["input_shape"], meta[name]["output_shape"][0]
        config = ModelConfig(
            name=name,
            version="1",
            platform="onnxruntime",
            inputs=[{"name": meta[name]["input"], "datatype": "FP32", "shape": [-1, *shape]}],
            outputs=[{"name": meta[name]["output"], "datatype": "FP32", "shape": [-1, classes]}],
            labels=[f"c{index}" for index in range(classes)],
            preprocessing=PreprocessSpec(height=shape[1], width=shape[2]).to_dict(),
            batching={"max_batch_size": max_batch[name], "max_queue_delay_us": 0, "max_queue_size": 256},
            drift_baseline=baseline,
        )
        write_version(repo, config, {"model.onnx": models / meta[name]["file"]})
    return repo


def model_files(work: Path) -> dict[str, Path]:
    """The ONNX file of each bench model, as ``make_models.py`` wrote them."""
    meta = json.loads((work / "models" / "models.json").read_text())
    return {name: work / "models" / meta[name]["file"] for name in MODELS}


@contextlib.contextmanager
def running_server(
    repo: Path, work: Path, prefix: list[str], *, env: Mapping[str, str] | None = None, log_name: str = "server.log"
) -> Iterator[Server]:
    """Our server on free loopback ports (ORT one intra-op thread), once /health/ready answers 200.

    ``env`` is the environment to start from (default ours: ``SLUICEGATE_SERVING__*`` pass through)."""
    grpc_port, http_port = free_port(), free_port()
    base = os.environ if env is None else env
    env = {**base, "SLUICEGATE_SERVING__ORT_THREADS": "1", "SLUICEGATE_SERVING__CACHE_DIR": str(work / "cache")}
    argv = [*prefix, sys.executable, "-m", "serving", "--repo", str(repo), "--host", "127.0.0.1"]
    argv += ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]

    def ready() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"http://127.0.0.1:{http_port}/health/ready", timeout=1).status_code == 200
        return False

    with started(argv, env, work / log_name, ready) as pid:
        yield Server(pid, grpc_port, work / log_name, http_port)


@contextlib.contextmanager
def running_reference(models: Mapping[str, Path], work: Path, prefix: list[str], *, max_batch: int) -> Iterator[Server]:
    """``benchmarks/reference_server.py`` on a free loopback port; it loads its models before it listens,
    so an accepted connection means ready."""
    port = free_port()
    argv = [*prefix, sys.executable, "-m", "benchmarks.reference_server", "--port", str(port)]
    argv += ["--max-batch", str(max_batch), *(f"{name}={path}" for name, path in models.items())]

    def ready() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return False

    log = work / "reference.log"
    with started(argv, {**os.environ, "PEERBENCH_ORT_THREADS": "1"}, log, ready) as pid:
        yield Server(pid, port, log)


@contextlib.contextmanager
def started(argv: list[str], env: Mapping[str, str], log_path: Path, ready: Callable[[], bool]) -> Iterator[int]:
    """Start ``argv`` in its own process group, output to ``log_path``; yield its pid once ``ready()``.

    Always stopped on the way out: SIGTERM to its process group, SIGKILL after ``STOP_GRACE_S``."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            if process.poll() is not None:
                raise RuntimeError(f"{argv[-1]} exited {process.returncode} before ready:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f} s: {' '.join(argv)}\n{tail(log_path)}")
            time.sleep(0.2)
        yield process.pid
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def log_problems(path: Path, keep: int = 5) -> tuple[int, list[str]]:
    """How many lines of a server log are warnings or errors, and the first ``keep`` of them (300 chars each)."""
    found = [line for line in path.read_text(errors="replace").splitlines() if PROBLEM.search(line)]
    return len(found), [line[:300] for line in found[:keep]]


def check(client: list[str], bench: Path, models: Path, target: str, model: str, label: str) -> None:
    """``v2load.py check``: the server's answer to the reference input against ORT's."""
    argv = [*client, sys.executable, str(bench / "v2load.py"), "check", "--target", target, "--model", model]
    lines = json_lines([*argv, "--label", label, "--models-dir", str(models)])
    if not lines or not all(line.get("ok") for line in lines):
        raise RuntimeError(f"{label} {model}: the server's answer differs from ORT's reference: {lines}")


def run_load(
    client: list[str], bench: Path, target: str, model: str, concurrency: str, timing: tuple[float, float], label: str
) -> list[dict[str, Any]]:
    """``v2load.py run`` at each concurrency of ``concurrency`` ("1,32"); ``timing`` is (duration, warm-up) s."""
    argv = [*client, sys.executable, str(bench / "v2load.py"), "run", "--target", target, "--model", model]
    argv += ["--label", label, "--shape", ",".join(map(str, SHAPES[model])), "--concurrency", concurrency]
    return json_lines([*argv, "--duration", str(timing[0]), "--warmup", str(timing[1])])


def v2_point(lines: list[dict[str, Any]], model: str, concurrency: int, label: str) -> dict[str, Any]:
    """The one ``v2grpc`` result line of a point; raise if the server answered any request with an error."""
    (line,) = [
        x
        for x in lines
        if x["kind"] == "v2grpc" and x["label"] == label and x["model"] == model and x["concurrency"] == concurrency
    ]
    if line["errors"]:
        raise RuntimeError(f"{label} {model} c={concurrency}: {line['errors']} errors, first: {line['first_error']}")
    return line


def revision() -> str:
    """The commit the server ran from, ``-dirty`` with local changes (the server changes under this table)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        argv = ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--exclude", "*"]
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    return "unknown (no git)"


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fill_defaults(
    args: argparse.Namespace, quick: Mapping[str, float], full: Mapping[str, float]
) -> argparse.Namespace:
    """Set every option left unset to its ``--quick`` or full default; a full run's ``duration`` comes
    from ``SLUICEGATE_BENCH_SECONDS`` when set (for ``make bench``, which passes no flags)."""
    seconds = os.environ.get("SLUICEGATE_BENCH_SECONDS")
    chosen = dict(quick if args.quick else full)
    if not args.quick and seconds:
        chosen["duration"] = float(seconds)
    for name, default in chosen.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def require_harness(bench: Path) -> None:
    if not (bench / "v2load.py").is_file():
        raise SystemExit(f"no harness at {bench}: pass --bench-dir DIR (the folder with v2load.py)")
