"""The embedded stack's recorded state: part statuses, ``<home>/run/state.json`` (written by the
supervisor, read by ``up``/``status``/``down``) and the supervisor's lock, which tells a live
supervisor from a stale state file."""

from __future__ import annotations

import fcntl
import json
from dataclasses import asdict, dataclass
from pathlib import Path

READY = "ready"
STARTING = "starting"
FAILED = "failed"
STOPPED = "stopped"


@dataclass
class PartState:
    name: str
    url: str
    log: str
    pid: int | None = None
    # With the pid, identifies the process: a stale state file must not make `down` kill a
    # process that reused the pid.
    created: float | None = None
    status: str = STARTING
    restarts: int = 0
    detail: str = ""


@dataclass
class StackState:
    status: str
    supervisor_pid: int
    parts: dict[str, PartState]
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StackState:
        raw = json.loads(text)
        parts = {name: PartState(**part) for name, part in raw["parts"].items()}
        return cls(status=raw["status"], supervisor_pid=raw["supervisor_pid"], parts=parts, error=raw.get("error", ""))


class Paths:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.run = home / "run"
        self.logs = home / "logs"
        self.state = self.run / "state.json"
        self.lock = self.run / "supervisor.lock"
        self.supervisor_log = self.logs / "supervisor.log"

    def make(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)


def supervisor_alive(paths: Paths) -> bool:
    """True while a supervisor holds the lock (robust against stale pid files)."""
    if not paths.lock.exists():
        return False
    with paths.lock.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def read_state(paths: Paths) -> StackState | None:
    try:
        return StackState.from_json(paths.state.read_text())
    except (OSError, ValueError, KeyError):
        return None
