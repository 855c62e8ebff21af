"""The serving harness's process and client plumbing: core plans, multi-channel sums, the loopback check."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import serving_harness
from benchmarks.serving_harness import (
    binding,
    combine,
    core_pins,
    free_port,
    group_pids,
    proc_address,
    proc_listeners,
    stop,
)


def test_on_two_cores_the_second_server_core_is_the_clients() -> None:
    one, two = core_pins(1, 2, [0, 1]), core_pins(2, 2, [0, 1])

    assert one is not None and (one.server_cpus, one.client_cpus, one.shared) == ("1", "0", False)
    assert two is not None and (two.server_cpus, two.client_cpus, two.shared) == ("0,1", "0", True)
    assert core_pins(8, 8, [0, 1]) is None


def test_on_sixteen_cores_servers_and_client_never_share() -> None:
    cores = list(range(16))
    plans = [core_pins(n, 8, cores) for n in (1, 2, 8)]

    assert [p.server_cpus for p in plans if p] == ["1", "1,2", "1,2,3,4,5,6,7,8"]
    assert {p.client_cpus for p in plans if p} == {"0,9,10,11,12,13,14,15"}  # one client for every point
    assert not any(p.shared for p in plans if p)


def line(rate: float, p50: float, concurrency: int = 16) -> dict[str, object]:
    return {
        "kind": "v2grpc",
        "label": "x",
        "model": "small",
        "concurrency": concurrency,
        "infer_per_s": rate,
        "req_per_s": rate,
        "client_cpu_util": 0.2,
        "n": int(rate * 4),
        "errors": 0,
        "first_error": None,
        "p50_ms": p50,
        "p99_ms": p50 * 3,
    }


def test_channels_add_up_and_keep_the_median_p50() -> None:
    found = combine([line(500, 20.0), line(700, 30.0), {"kind": "check"}], "ours@2", 2)

    assert (found["infer_per_s"], found["concurrency"], found["channels"]) == (1200, 32, 2)
    assert found["p50_ms"] == 25.0 and found["p99_ms"] == 90.0
    assert found["client_cpu_util"] == 0.4


def test_a_missing_channel_fails_the_point() -> None:
    with pytest.raises(RuntimeError, match="2 load processes gave 1 result lines"):
        combine([line(500, 20.0)], "ours@2", 2)


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


@contextlib.contextmanager
def listener(host: str) -> Iterator[subprocess.Popen[bytes]]:
    """A real listening server in its own process group (``http.server``), stopped like a bench server."""
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", host, str(port)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not listening(port):
            assert time.monotonic() < deadline, "http.server did not start"
            time.sleep(0.05)
        yield process
    finally:
        stop(process)


def test_binding_lists_a_loopback_server_and_its_cores() -> None:
    with listener("127.0.0.1") as process:
        found = binding(process.pid, "probe")

    assert found["procs"] == 1
    assert found["addrs"]
    assert all(addr.startswith("127.0.0.1:") for addr in found["addrs"])
    assert found["cpus"]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_without_ss_the_listeners_are_read_from_proc_as_ss_writes_them(host: str) -> None:
    with listener(host) as process:
        found = proc_listeners({process.pid})
    port = process.args[-1]
    assert found == [f"{host}:{port}"]


def test_proc_addresses_read_like_ss() -> None:
    assert proc_address("0100007F:1F90") == "127.0.0.1:8080"
    assert proc_address("00000000000000000000000001000000:1F91") == "[::1]:8081"
    assert proc_address("0000000000000000FFFF00000100007F:0050") == "[::ffff:127.0.0.1]:80"


def test_binding_refuses_a_server_listening_beyond_loopback() -> None:
    with listener("0.0.0.0") as process, pytest.raises(RuntimeError, match="probe listens beyond loopback"):
        binding(process.pid, "probe")


def test_stop_leaves_nothing_of_the_group(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    script = tmp_path / "tree.py"  # a leader that dies on SIGTERM and a child that ignores it
    script.write_text(
        "import pathlib, subprocess, sys, time\n"
        "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'\n"
        "subprocess.Popen([sys.executable, '-c', code])\n"
        f"time.sleep(0.5); pathlib.Path({str(ready)!r}).touch(); time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    for _ in range(100):
        if ready.exists():
            break
        time.sleep(0.1)
    assert len(group_pids(process.pid)) == 2

    stop(process, grace_s=1.0)

    assert group_pids(process.pid) == []


def test_a_clone_finds_the_harness_beside_the_repository_it_was_cloned_from(tmp_path: Path) -> None:
    origin = tmp_path / "work" / "main"
    (tmp_path / "work" / "shared" / "bench").mkdir(parents=True)
    (tmp_path / "work" / "shared" / "bench" / "v2load.py").write_text("")
    origin.mkdir()
    subprocess.run(["git", "init", "-q", str(origin)], check=True)
    subprocess.run(["git", "clone", "-q", str(origin), str(tmp_path / "x")], check=True, capture_output=True)

    assert serving_harness.default_bench_dir(tmp_path / "x") == tmp_path / "work" / "shared" / "bench"
    assert serving_harness.default_bench_dir(origin) == tmp_path / "work" / "shared" / "bench"
