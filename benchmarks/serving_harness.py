"""What the serving benchmarks share: the bench models as a model repository, servers started and always
stopped, the peers' load client, CPU accounting.

Servers run pinned to core 1 and the client to core 0 (``taskset``), each server in its own process
group, stopped with SIGTERM to the group and SIGKILL after ``STOP_GRACE_S``. The load client and the
models are the shared harness's (``shared/bench``: ``v2load.py``, ``make_models.py``, ``ort_limit.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def default_bench_dir(root: Path = ROOT) -> Path:
    """The shared harness: ``shared/bench`` beside this checkout, or beside the repository it was cloned
    from (``git clone . /tmp/x && cd /tmp/x && make bench`` must find the same harness)."""
    roots = [root, root.parent]
    origin = _origin_path(root)
    if origin is not None:
        roots += [origin, origin.parent]
    for root in roots:
        candidate = root / "shared" / "bench"
        if (candidate / "v2load.py").is_file():
            return candidate
    return root.parent / "shared" / "bench"


def _origin_path(root: Path) -> Path | None:
    """The folder this checkout was cloned from, when its origin is a local path."""
    try:
        url = subprocess.run(
            ["git", "-C", str(root), "config", "--get", "remote.origin.url"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    url = url.removeprefix("file://")
    return Path(url).resolve() if url.startswith("/") else None


def pinning() -> tuple[list[str], list[str], str]:
    """``taskset`` prefixes for the server and the client, and a note when they cannot be pinned."""
    if shutil.which("taskset") is None:
        return [], [], "taskset not found: server and client NOT pinned (numbers not comparable with the peers)"
    if not {SERVER_CPU, CLIENT_CPU} <= os.sched_getaffinity(0):
        return [], [], f"cores {CLIENT_CPU} and {SERVER_CPU} not both available: NOT pinned"
    note = f"server on core {SERVER_CPU}, client on core {CLIENT_CPU} (taskset)"
    return ["taskset", "-c", str(SERVER_CPU)], ["taskset", "-c", str(CLIENT_CPU)], note


@dataclass(frozen=True)
class CorePins:
    """``taskset`` prefixes for a server on ``cores`` cores and its client, and whether they share one."""

    cores: int
    server: list[str]
    client: list[str]
    server_cpus: str
    client_cpus: str
    shared: bool


def core_pins(cores: int, most: int, avail: Sequence[int] | None = None) -> CorePins | None:
    """The server on ``cores`` cores and the client on core 0, the same client cores for every point up to
    ``most`` (plus the cores no server point uses, where there are any). On a 2-core machine the 2-core
    server takes core 0 too, so it shares it with the client (``shared``). None: not enough cores, or no
    taskset. ``avail``: the cores to use (default: this process's affinity)."""
    avail = sorted(os.sched_getaffinity(0) if avail is None else avail)
    if shutil.which("taskset") is None or cores > len(avail):
        return None
    if len(avail) > most:
        server, client = avail[1 : cores + 1], [avail[0], *avail[most + 1 :]]
    else:
        server, client = (avail[1 : cores + 1] if cores < len(avail) else avail[:cores]), [avail[0]]
    server_cpus, client_cpus = ",".join(map(str, server)), ",".join(map(str, client))
    return CorePins(
        cores,
        ["taskset", "-c", server_cpus],
        ["taskset", "-c", client_cpus],
        server_cpus,
        client_cpus,
        bool(set(server) & set(client)),
    )


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
    # No load balancer to wait for between points: stop at once (the 5 s default is for pods).
    env.setdefault("SLUICEGATE_SERVING__SHUTDOWN_DELAY_S", "0")
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

    log = work / "reference.log"
    with started(argv, {**os.environ, "PEERBENCH_ORT_THREADS": "1"}, log, functools.partial(accepts, port)) as pid:
        yield Server(pid, port, log)


@contextlib.contextmanager
def running_native(
    models: Mapping[str, Path],
    work: Path,
    prefix: list[str],
    *,
    max_batch: int,
    module_dir: Path,
    records: Path | None = None,
) -> Iterator[Server]:
    """``benchmarks/native_reference`` (the C++ front end built in ``module_dir``) on a free loopback port,
    recording every request into ``records`` when given; like the grpcio reference it loads its models
    before it listens."""
    port = free_port()
    argv = [*prefix, sys.executable, "-m", "benchmarks.native_reference", "--port", str(port)]
    argv += ["--module-dir", str(module_dir), "--max-batch", str(max_batch)]
    argv += ["--records", str(records)] if records else []
    argv += [f"{name}={path}" for name, path in models.items()]

    log = work / ("native-recorded.log" if records else "native.log")
    with started(argv, {**os.environ, "PEERBENCH_ORT_THREADS": "1"}, log, functools.partial(accepts, port)) as pid:
        yield Server(pid, port, log)


def accepts(port: int) -> bool:
    """Whether a loopback connection to ``port`` is accepted: ready, for the references, which load their
    models before they listen."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


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


def stop(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace_s``; then SIGKILL whatever of the group
    outlived its leader (a peer's child, e.g. Triton's backend stub), so no server lingers on a core."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    deadline = time.monotonic() + grace_s
    while group_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_pids(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group_pids(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (/proc/PID/stat field 5), zombies excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


LISTENER_PID = re.compile(r"pid=(\d+),")
LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")


def listening(pids: set[int]) -> list[str]:
    """The addresses the processes ``pids`` listen on (TCP and UDP), from ``ss``, else from /proc (an image
    without iproute2, like the GPU machine's: its TCP listeners, matched to the processes' socket inodes)."""
    if shutil.which("ss") is not None:
        listing = subprocess.run(["ss", "-H", "-ltunp"], capture_output=True, text=True, check=False).stdout
        return [
            line.split()[4]
            for line in listing.splitlines()
            if len(line.split()) > 4 and pids & {int(pid) for pid in LISTENER_PID.findall(line)}
        ]
    return proc_listeners(pids)


def proc_listeners(pids: set[int]) -> list[str]:
    """The TCP addresses the processes ``pids`` listen on, read from /proc."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = str(fd.readlink())
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    addrs = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    addrs.append(proc_address(fields[1]))
    return addrs


def proc_address(field: str) -> str:
    """``/proc/net/tcp*``'s ``HEX_IP:HEX_PORT`` as ``ss`` writes it (the IP in host-order 32-bit words)."""
    import ipaddress

    host, port = field.split(":")
    raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    if ip.version == 4:
        return f"{ip}:{int(port, 16)}"
    mapped = ip.ipv4_mapped  # written ::ffff:a.b.c.d by ss, whatever this Python's str() of it says
    return f"[::ffff:{mapped}]:{int(port, 16)}" if mapped else f"[{ip}]:{int(port, 16)}"


def binding(pgid: int, label: str) -> dict[str, Any]:
    """What ``run_peers.sh`` checks before loading a server: every listening socket of its process group is
    on loopback (raise otherwise), and which cores each of its processes may run on."""
    pids = set(group_pids(pgid))
    addrs = listening(pids)
    cpus = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            cpus |= {line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")}
    outside = [addr for addr in addrs if not addr.startswith(LOOPBACK)]
    if outside:
        raise RuntimeError(f"{label} listens beyond loopback ({', '.join(outside)}): refusing to load it")
    return {"kind": "bind", "label": label, "procs": len(pids), "cpus": " ".join(sorted(cpus)), "addrs": addrs}


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


def grpc_ready(port: int, models: Sequence[str]) -> Callable[[], bool]:
    """A readiness probe for any V2 gRPC server: ServerLive, then ModelReady for each model."""
    import grpc  # here, not at import: observability_overhead.py never needs it

    from serving.proto import grpc_service_pb2 as pb
    from serving.proto import grpc_service_pb2_grpc as pbg

    def ready() -> bool:
        with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pbg.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            if not stub.ServerLive(pb.ServerLiveRequest(), timeout=2).live:
                return False
            return all(stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=2).ready for name in models)
        return False

    return ready


def run_channels(
    client: list[str],
    bench: Path,
    target: str,
    model: str,
    channels: int,
    concurrency: int,
    timing: tuple[float, float],
    label: str,
) -> dict[str, Any]:
    """``channels`` v2load processes at once, ``concurrency`` requests in flight each, one ``v2grpc`` line
    with their sum: a server whose processes share a port with SO_REUSEPORT gets its connections spread by
    the kernel, and one v2load channel is one connection, so it would load one process only.

    The processes start together and count over the same warm-up and window (each its own clock: they
    overlap to within their start-up, a fraction of a second). ``infer_per_s``, ``req_per_s``, ``n``,
    ``errors`` and ``client_cpu_util`` are summed; ``p50_ms``/``p99_ms`` are the median/largest of theirs."""
    argv = [*client, sys.executable, str(bench / "v2load.py"), "run", "--target", target, "--model", model]
    argv += ["--label", label, "--shape", ",".join(map(str, SHAPES[model])), "--concurrency", str(concurrency)]
    argv += ["--duration", str(timing[0]), "--warmup", str(timing[1])]
    running = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(channels)
    ]
    parts = []
    for process in running:
        out, err = process.communicate(timeout=900)
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}:\n{out}\n{err[-4000:]}")
        parts += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return combine(parts, label, channels)


def combine(parts: list[dict[str, Any]], label: str, channels: int) -> dict[str, Any]:
    """One ``v2grpc`` line from the lines of several concurrent v2load processes (see ``run_channels``)."""
    lines = [x for x in parts if x["kind"] == "v2grpc"]
    if len(lines) != channels:
        raise RuntimeError(f"{label}: {channels} load processes gave {len(lines)} result lines: {parts}")
    errors = [x["first_error"] for x in lines if x["errors"]]
    return {
        **lines[0],
        "label": label,
        "channels": channels,
        "concurrency": sum(int(x["concurrency"]) for x in lines),
        **{key: round(sum(float(x[key]) for x in lines), 3) for key in ("infer_per_s", "req_per_s", "client_cpu_util")},
        "n": sum(int(x["n"]) for x in lines),
        "errors": sum(int(x["errors"]) for x in lines),
        "first_error": errors[0] if errors else None,
        "p50_ms": statistics.median(float(x["p50_ms"]) for x in lines),
        "p99_ms": max(float(x["p99_ms"]) for x in lines),
        "per_channel": [{key: x[key] for key in ("infer_per_s", "p50_ms", "client_cpu_util")} for x in lines],
    }


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
