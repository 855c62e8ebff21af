"""The embedded stack: S3+SQS (moto), Prefect server, MLflow server, the local model server, the event
bridge and a runner, as supervised child processes of one detached supervisor.

``up`` starts the supervisor and waits until every part is healthy; the supervisor restarts a part
that dies (up to ``stack.max_restarts``) and, on SIGTERM, stops every part and every process those
parts started (flow runs included). State lives under ``<home>/run``; logs under ``<home>/logs``.
A part whose service is configured externally (a URL setting) is not started.

Modules: ``services`` (what each part runs), ``supervisor`` (the detached process that keeps them
alive), ``control`` (``up``/``status``/``down`` from outside), ``state`` (the state file and the
supervisor's lock), ``processes`` (health probes and process-tree handling).
"""

from sluicegate.app.stack.control import PartHealth, describe, down, running, status, up
from sluicegate.app.stack.processes import healthy, kill_tree, tail
from sluicegate.app.stack.services import SERVICES, Part, child_env, local_admin_token, parts
from sluicegate.app.stack.state import (
    FAILED,
    READY,
    STARTING,
    STOPPED,
    PartState,
    Paths,
    StackState,
    read_state,
    supervisor_alive,
)
from sluicegate.app.stack.supervisor import Supervisor, supervise

__all__ = [
    "FAILED",
    "READY",
    "SERVICES",
    "STARTING",
    "STOPPED",
    "Part",
    "PartHealth",
    "PartState",
    "Paths",
    "StackState",
    "Supervisor",
    "child_env",
    "describe",
    "down",
    "healthy",
    "kill_tree",
    "local_admin_token",
    "parts",
    "read_state",
    "running",
    "status",
    "supervise",
    "supervisor_alive",
    "tail",
    "up",
]
