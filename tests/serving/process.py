"""The server as its own process (`python -m serving`), for tests that need a signal, a clean RSS figure
or a server that hostile input must not take down: started with extra ``SLUICEGATE_SERVING__*``
settings, ready when ``/health/ready`` answers 200 (plain HTTP, or HTTPS with the test CA)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.fixtures.services import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hostile-probe-admin-token"
# RSS after a hostile probe may exceed the server's RSS before it by this share at most (issue 18).
RSS_SLACK = 0.20


class ServerProcess:
    """``python -m serving --repo REPO`` on two free ports; ``env`` adds settings (names without the
    prefix, e.g. ``{"ADMIN_TOKEN": "x"}``), ``environ`` other variables (``TMPDIR``); ``verify`` is the CA
    (an ``ssl.SSLContext``) when TLS is on."""

    def __init__(
        self,
        repo: Path,
        tmp: Path,
        env: Mapping[str, str] | None = None,
        *,
        verify: ssl.SSLContext | None = None,
        ready_timeout: float = 120,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.log = tmp / f"server-{self.grpc_port}.log"
        self.verify = verify
        settings = {"CACHE_DIR": str(tmp / "cache"), "PROBE_INTERVAL_S": "0", **(env or {})}
        self.runtime_dir = Path(settings["RUNTIME_DIR"]) if "RUNTIME_DIR" in settings else None
        environ = {**os.environ, **(environ or {}), **{f"SLUICEGATE_SERVING__{k}": v for k, v in settings.items()}}
        args = [sys.executable, "-m", "serving", "--repo", str(repo), "--grpc-port", str(self.grpc_port)]
        args += ["--http-port", str(self.http_port)]
        self.proc = subprocess.Popen(args, cwd=ROOT, env=environ, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            try:
                if self.http("GET", "/health/ready", timeout=1).status_code == 200:
                    self.warm_up()
                    self.start_rss = self.rss()
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise AssertionError("server did not become ready:\n" + self.log.read_text()[-3000:])

    def warm_up(self, requests: int = 64, threads: int = 8) -> None:
        """Ordinary traffic first, so ``start_rss`` counts what serving costs (gRPC's worker threads,
        the allocator's per-thread heaps, the batcher's buffers) and a probe is judged on what it adds."""
        if self.verify is not None:
            return  # the TLS tests make their own clients; memory is not what they check
        client = self.client()
        inputs = []
        try:
            index = client.get_model_repository_index(as_json=True).get("models", [])
        except InferenceServerException:
            index = []  # a server whose index needs the token: no warm-up, the start-up RSS stands
        for model in index:
            if model.get("state") != "READY":
                continue
            meta = client.get_model_metadata(model["name"], as_json=True)
            tensors = []
            for tensor in meta["inputs"]:
                if tensor["datatype"] != "FP32":
                    break
                shape = [1 if int(d) < 0 else int(d) for d in tensor["shape"]]
                given = triton.InferInput(tensor["name"], shape, "FP32")
                given.set_data_from_numpy(np.zeros(shape, np.float32))
                tensors.append(given)
            else:
                inputs.append((model["name"], tensors))

        def send(i: int) -> None:
            name, tensors = inputs[i % len(inputs)]
            client.infer(name, tensors)
            self.http("GET", "/metrics", timeout=10)

        if inputs:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(send, range(requests)))

    @property
    def base_url(self) -> str:
        return f"{'https' if self.verify else 'http'}://127.0.0.1:{self.http_port}"

    def http(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.base_url + path, verify=self.verify or True, **kwargs)

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def assert_recovered(self, what: str, *, settle_s: float = 10.0) -> None:
        """The server is alive, ready, and back within ``RSS_SLACK`` of its RSS at start-up (waiting up to
        ``settle_s`` for memory to be released)."""
        assert self.proc.poll() is None, f"server died after {what}:\n" + self.log.read_text()[-3000:]
        assert self.http("GET", "/health/ready", timeout=10).status_code == 200, f"not ready after {what}"
        limit = self.start_rss * (1 + RSS_SLACK)
        deadline = time.monotonic() + settle_s
        while self.rss() > limit and time.monotonic() < deadline:
            time.sleep(0.25)
        assert self.rss() <= limit, (
            f"RSS {self.rss() / 2**20:.0f} MiB after {what}, start {self.start_rss / 2**20:.0f} MiB (+20% allowed)"
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[dict[str, Any]]:
        """Each joined worker's own account (pid, ready, models, weights, requests per version), asked on
        its private socket: a connection to the public ports reaches whichever worker the kernel picks."""
        from serving.siblings import call, sibling_sockets

        assert self.runtime_dir is not None, "workers() needs RUNTIME_DIR in the env"
        secret = (self.runtime_dir / "secret").read_text()
        return [call(path, "Describe", b"", secret, timeout=10) for _, path in sibling_sockets(self.runtime_dir)]

    def wait_workers(self, count: int, timeout: float = 120, exclude_pids: frozenset[int] = frozenset()) -> None:
        """Until ``count`` workers (none of ``exclude_pids``) are ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ready = [w for w in self.workers() if w["ready"] and w["pid"] not in exclude_pids]
            except Exception:  # a socket of a worker that just died or is starting
                ready = []
            if len(ready) == count:
                return
            time.sleep(0.2)
        raise AssertionError(f"{count} workers not ready:\n" + self.log_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            for child in self.ps.children(recursive=True):  # workers of a supervisor
                child.kill()
            self.proc.kill()
            self.proc.wait()
