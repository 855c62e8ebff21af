"""The peers the serving benchmark measures beside ours: Triton (PyTriton, dynamic batching) and KServe.

Their venvs and models come from the shared harness's ``setup_venvs.sh`` (``shared/bench``, read-only),
under a peer root outside the repository (``--peer-root``; default ``$SLUICEGATE_BENCH_PEER_ROOT``, else
``$PB_ROOT``, else ``/tmp/peerbench``, the harness's own default, so a root it set up is reused). When a
piece is missing, ``ensure_peers`` runs the script once: it waits for a setup already running on the
machine, takes a lock so two benchmarks never install at once, writes the script's output to
``<root>/setup.log`` and names that log if the script fails.

The servers are started the way ``run_peers.sh`` starts them, with the harness's own launchers
(``peers/pytriton/serve_pytriton.py``, ``peers/kserve/serve_kserve.py``) and settings (dynamic batcher
max 32 rows / 2,000 µs for Triton, no batching in KServe, one ORT intra-op thread), but from here: on free
loopback ports instead of the fixed 8100/8300 ones (another engineer's ``run_peers.sh`` may hold those),
pinned and stopped by ``serving_harness`` like ours, with the same readiness probe, loopback check and
client.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from benchmarks.serving_harness import Server, free_port, grpc_ready, progress, started, tail

DEFAULT_ROOT = Path("/tmp/peerbench")
ROOT_ENV = ("SLUICEGATE_BENCH_PEER_ROOT", "PB_ROOT")  # ours first, then the shared harness's
SETUP_WAIT_S = 45 * 60.0  # pip installs of five venvs, Triton's wheel alone is ~1 GB
TRITON_MAX_BATCH, TRITON_MAX_DELAY_US = 32, 2000  # run_peers.sh's MAX_BATCH / MAX_BATCH_DELAY_US
PEER_ORT_THREADS = "1"


def default_root(environ: Mapping[str, str]) -> Path:
    """The peer root from the environment (read by the entry point and passed here)."""
    for name in ROOT_ENV:
        if environ.get(name):
            return Path(environ[name]).expanduser()
    return DEFAULT_ROOT


def missing(root: Path) -> list[str]:
    """What a finished ``setup_venvs.sh`` leaves and ``root`` lacks (models.json is its last step)."""
    wanted = ("venv-kserve/bin/python", "venv-pytriton/bin/python", "models/models.json")
    return [path for path in wanted if not (root / path).exists()]


def setups_running() -> list[int]:
    """Pids of any ``setup_venvs.sh`` running on the machine (started by us or by anyone else)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and b"setup_venvs.sh" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def ensure_peers(bench: Path, root: Path) -> None:
    """Make sure the peers' venvs and models exist under ``root``: wait for a setup in progress, else run
    ``setup_venvs.sh`` once (output to ``root/setup.log``).

    Raises:
        SystemExit: the setup failed or did not finish in ``SETUP_WAIT_S``; the message names the log.
    """
    if not missing(root):
        return
    deadline = time.monotonic() + SETUP_WAIT_S
    while (running := setups_running()) and missing(root):
        if time.monotonic() > deadline:
            raise SystemExit(f"setup_venvs.sh (pids {running}) still running after {SETUP_WAIT_S:.0f} s")
        progress(f"peers: waiting for the setup already running (pids {running}) to fill {root}...")
        time.sleep(15)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "setup.log"
    with (root / ".setup.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another benchmark installing into this root: wait for it
        if not missing(root):
            return
        progress(f"peers: {', '.join(missing(root))} missing under {root}; running setup_venvs.sh (log {log})...")
        with log.open("wb") as out:
            done = subprocess.run(
                ["bash", str(bench / "setup_venvs.sh")],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PB_ROOT": str(root)},
                timeout=SETUP_WAIT_S,
                check=False,
            )
    if done.returncode != 0 or missing(root):
        raise SystemExit(
            f"setting up the peers failed (setup_venvs.sh exited {done.returncode}; still missing "
            f"{missing(root)}); see {log}:\n{tail(log, 2000)}\nOr run without peers: --no-peers"
        )


def peer_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a peer: ours minus our server's settings, the peers' ORT thread count."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLUICEGATE_")}
    return {**base, "PEERBENCH_ORT_THREADS": PEER_ORT_THREADS, **(extra or {})}


@contextlib.contextmanager
def running_kserve(
    root: Path, bench: Path, models_dir: Path, models: Sequence[str], work: Path, prefix: list[str], log_name: str
) -> Iterator[Server]:
    """KServe 0.21 ``ModelServer`` with the harness's ORT ``kserve.Model`` (no batching: KServe has none)."""
    grpc_port, http_port = free_port(), free_port()
    argv = [*prefix, str(root / "venv-kserve/bin/python"), str(bench / "peers/kserve/serve_kserve.py")]
    argv += ["--models-dir", str(models_dir), "--models", ",".join(models)]
    argv += ["--grpc-port", str(grpc_port), "--http-port", str(http_port)]
    with started(argv, peer_env(), work / log_name, grpc_ready(grpc_port, models)) as pid:
        yield Server(pid, grpc_port, work / log_name)


@contextlib.contextmanager
def running_triton(
    root: Path, bench: Path, models_dir: Path, models: Sequence[str], work: Path, prefix: list[str], log_name: str
) -> Iterator[Server]:
    """Triton (the binary in ``nvidia-pytriton``) serving the harness's ORT callable, dynamic batcher on."""
    python = root / "venv-pytriton/bin/python"
    libdir = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    argv = [*prefix, str(python), str(bench / "peers/pytriton/serve_pytriton.py")]
    argv += ["--models-dir", str(models_dir), "--models", ",".join(models)]
    argv += ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    argv += ["--max-batch", str(TRITON_MAX_BATCH), "--max-queue-delay-us", str(TRITON_MAX_DELAY_US)]
    # LD_LIBRARY_PATH: the python backend stub must load the venv's libpython (serve_pytriton.py says why)
    env = peer_env({"LD_LIBRARY_PATH": libdir, "PEERBENCH_PYTRITON_TOKEN": secrets.token_hex(16)})
    with started(argv, env, work / log_name, grpc_ready(grpc_port, models)) as pid:
        yield Server(pid, grpc_port, work / log_name)


def versions(root: Path) -> dict[str, str]:
    """The peers' package versions, as installed under ``root``."""
    found = {}
    for venv, package in (("venv-pytriton", "nvidia-pytriton"), ("venv-kserve", "kserve")):
        code = f"from importlib.metadata import version as v; print(v('{package}'), v('onnxruntime'))"
        done = subprocess.run(
            [str(root / venv / "bin/python"), "-c", code], capture_output=True, text=True, check=False
        )
        pkg, ort = [*done.stdout.split(), "?", "?"][:2]
        found[package] = f"{pkg} (onnxruntime {ort})"
    return found
