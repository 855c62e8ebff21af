"""Process tools of the embedded stack: a health probe, a log's last lines, stopping a process with
everything it started, and telling a live process from one that reused its pid."""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import httpx
import psutil


def healthy(url: str, timeout: float = 2.0, verify: ssl.SSLContext | bool = True) -> bool:
    try:
        return httpx.get(url, timeout=timeout, verify=verify).status_code < 500
    except httpx.HTTPError:
        return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill_tree(pid: int, timeout: float) -> None:
    """SIGTERM a process and everything it started, then SIGKILL what is left after ``timeout``."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    # Children spawned while we waited (a runner starting a flow run) are caught here too.
    for leftover in alive + [child for proc in alive for child in _children(proc)]:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    psutil.wait_procs(alive, timeout=5)


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return list(proc.children(recursive=True))
    except psutil.Error:
        return []


def process_running(pid: int, created: float | None = None) -> bool:
    """Alive, not a zombie (exited, not yet reaped), and (when known) the same process we started."""
    try:
        proc = psutil.Process(pid)
        same = created is None or abs(proc.create_time() - created) < 1.0
        return bool(same and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
