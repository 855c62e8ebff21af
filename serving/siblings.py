"""What keeps the worker processes of one server (serving/supervisor.py) serving the same thing.

The kernel hands each connection to one worker (SO_REUSEPORT), so an admin change (repository load or
unload, traffic weights; gRPC or REST) reaches one worker only. ``SharedDataPlane`` makes it the cluster's:
under a lock file shared by the workers it applies the change here, records it in the shared state file,
then forwards it to every sibling over the sibling's private unix socket (``sluicegate.workers.Sync``,
reachable only through the supervisor's 0700 runtime folder and carrying the supervisor's secret), and
answers only once every sibling applied it; a sibling's failure is an error that names the worker.

The lock gives the changes one order on every worker. A (re)started worker loads the repository, then
``join()``s under the same lock: it replays the state file (unloads, loads, weights), opens its socket and
only then reports ready. A change made before it joined is in the file; one made after reaches its socket.
A sibling whose socket does not answer (dead, or not joined yet) is skipped for the same reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from serving.dataplane import DataPlane
from serving.errors import ModelNotFound, ServingError, clip

log = logging.getLogger(__name__)

SERVICE = "sluicegate.workers.Sync"
SECRET_HEADER = "x-sluicegate-worker-secret"
# A forwarded load builds the sibling's runtime (a TensorRT engine build can take minutes).
APPLY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class WorkerRole:
    """One worker's place in the supervisor's runtime folder (see ``serving.supervisor.RuntimeDir``)."""

    index: int
    runtime_dir: Path

    @property
    def metrics_dir(self) -> Path:
        return self.runtime_dir / "metrics"

    @property
    def socket(self) -> Path:
        return socket_path(self.runtime_dir, self.index)

    def secret(self) -> str:
        return (self.runtime_dir / "secret").read_text().strip()


def socket_path(runtime_dir: Path, index: int) -> Path:
    return runtime_dir / "workers" / f"worker-{index}.sock"


@dataclass(frozen=True)
class Change:
    """An admin change: ``op`` is load, unload or weights (with ``weights``, the mapping as sent)."""

    op: str
    model: str
    weights: dict[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"op": self.op, "model": self.model, "weights": self.weights}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Change:
        body = json.loads(raw)
        return cls(str(body["op"]), str(body["model"]), {str(k): int(v) for k, v in body["weights"].items()})

    def __str__(self) -> str:
        what = f" {self.weights}" if self.op == "weights" else ""
        return f"{self.op} of model {clip(self.model)!r}{what}"


class WorkersDisagree(ServingError):
    """A change applied here but not on every sibling: the workers now serve different things."""


class SharedDataPlane(DataPlane):
    """A worker's data plane: admin changes apply to every worker (see the module docstring)."""

    def __init__(self, *args: Any, role: WorkerRole, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.role = role
        self._secret = role.secret()
        self._joined = False
        self._sync: grpc.Server | None = None

    # -- the admin calls the servicers make ------------------------------------------------------

    def load_model(self, name: str) -> None:
        self._change(Change("load", name))

    def unload_model(self, name: str) -> None:
        self._change(Change("unload", name))

    def set_weights(self, name: str, weights: Mapping[str, int]) -> dict[str, int]:
        return self._change(Change("weights", name, dict(weights)))

    def _change(self, change: Change) -> dict[str, int]:
        with self._cluster_lock():
            result = self.apply(change)  # fails here first: then nothing changed anywhere
            self._record(change)
            failed = self._forward(change)
        if failed:
            raise WorkersDisagree(
                f"{change} applied on worker {self.role.index} but failed on "
                + "; ".join(f"worker {index}: {reason}" for index, reason in failed)
                + ": the workers now serve different things; repeat the call"
            )
        return result

    def apply(self, change: Change, *, forwarded: bool = False) -> dict[str, int]:
        """Apply ``change`` to this worker only. A forwarded unload of a model already gone succeeds: the
        sibling that took the call had it, and the result is the same."""
        if change.op == "load":
            super().load_model(change.model)
        elif change.op == "unload":
            try:
                super().unload_model(change.model)
            except ModelNotFound:
                if not forwarded:
                    raise
        elif change.op == "weights":
            return super().set_weights(change.model, change.weights)
        else:
            raise ValueError(f"unknown change {change.op!r}")
        return {}

    # -- readiness and membership ----------------------------------------------------------------

    def load_all(self) -> None:
        try:
            super().load_all()
        finally:
            self.join()

    def ready(self) -> bool:
        # Not before join(): until the replay, this worker may serve what the others no longer do.
        return self._joined and super().ready()

    def join(self) -> None:
        """Catch up with the changes made so far, then take forwarded changes on the private socket."""
        with self._cluster_lock():
            for change in self._recorded():
                try:
                    self.apply(change, forwarded=True)
                except ServingError as exc:
                    log.error("worker %d could not replay %s: %s", self.role.index, change, exc)
            self._sync = self._serve_sync()
            self._joined = True
        log.info("worker %d joined (pid %d)", self.role.index, os.getpid())
        self.publish_readiness()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.stop(None)
            self.role.socket.unlink(missing_ok=True)
        super().close()

    def describe(self) -> dict[str, Any]:
        """This worker as the private socket's Describe answers it (tests reach each worker this way)."""
        stats = self.stats()
        models: dict[str, list[str]] = {}
        for name, version, _ in stats:
            models.setdefault(name, []).append(version)
        return {
            "worker": self.role.index,
            "pid": os.getpid(),
            "ready": self.ready(),
            "models": models,
            "weights": {name: self.traffic.weights(name) for name in models},
            "requests": {f"{name}/{version}": s.requests for name, version, s in stats},
        }

    # -- the shared state file and lock ----------------------------------------------------------

    @contextlib.contextmanager
    def _cluster_lock(self) -> Iterator[None]:
        with (self.role.runtime_dir / "state.lock").open("a+b") as handle:
            # Held for a whole change, siblings included; the kernel releases it if this process dies.
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _recorded(self) -> list[Change]:
        """The state file as the changes that rebuild it: unloads and loads, then weights."""
        try:
            state = json.loads((self.role.runtime_dir / "state.json").read_text())
        except FileNotFoundError:
            return []
        changes = [Change(op, model) for model, op in state["models"].items()]
        return changes + [Change("weights", model, weights) for model, weights in state["weights"].items()]

    def _record(self, change: Change) -> None:
        """Fold ``change`` into the state file (written aside and renamed: a reader never sees half)."""
        path = self.role.runtime_dir / "state.json"
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            state = {"models": {}, "weights": {}}
        if change.op == "weights":
            state["weights"][change.model] = change.weights
        else:
            state["models"][change.model] = change.op
            if change.op == "unload":
                state["weights"].pop(change.model, None)  # an unload forgets the weights here too
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(state))
        partial.replace(path)

    # -- forwarding ------------------------------------------------------------------------------

    def _forward(self, change: Change) -> list[tuple[int, str]]:
        """Send ``change`` to every sibling; the (index, reason) of those that failed it."""
        failed = []
        for index, path in sibling_sockets(self.role.runtime_dir):
            if index == self.role.index:
                continue
            try:
                answer = call(path, "Apply", change.encode(), self._secret, timeout=APPLY_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    # Not listening: dead (the supervisor restarts it) or not joined yet; either way it
                    # replays the state file, which already holds this change, when it joins.
                    log.warning("worker %d unreachable for %s; it catches up when it (re)joins", index, change)
                    continue
                failed.append((index, f"{exc.code().name}: {exc.details()}"))
                continue
            if "error" in answer:
                failed.append((index, str(answer["error"])))
        return failed

    def _serve_sync(self) -> grpc.Server:
        def apply(raw: bytes, context: grpc.ServicerContext) -> bytes:
            self._check(context)
            change = Change.decode(raw)
            try:
                self.apply(change, forwarded=True)
            except ServingError as exc:
                log.error("worker %d could not apply the forwarded %s: %s", self.role.index, change, exc)
                return json.dumps({"error": f"{exc.code.name}: {exc}"}).encode()
            log.info("worker %d applied the forwarded %s", self.role.index, change)
            return b"{}"

        def describe(raw: bytes, context: grpc.ServicerContext) -> bytes:
            self._check(context)
            return json.dumps(self.describe()).encode()

        handlers = {
            "Apply": grpc.unary_unary_rpc_method_handler(apply),
            "Describe": grpc.unary_unary_rpc_method_handler(describe),
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sync"))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.role.socket.unlink(missing_ok=True)  # a dead predecessor's
        server.add_insecure_port(f"unix:{self.role.socket}")
        server.start()
        return server

    def _check(self, context: grpc.ServicerContext) -> None:
        given = dict(context.invocation_metadata()).get(SECRET_HEADER, "")
        if not hmac.compare_digest(str(given), self._secret):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a sibling worker")


def sibling_sockets(runtime_dir: Path) -> list[tuple[int, Path]]:
    """(index, socket) of every worker that has joined, by index."""
    found = []
    for path in (runtime_dir / "workers").glob("worker-*.sock"):
        index = path.stem.removeprefix("worker-")
        if index.isdigit():
            found.append((int(index), path))
    return sorted(found)


def call(path: Path, method: str, body: bytes, secret: str, *, timeout: float) -> dict[str, Any]:
    """One call to the worker listening on ``path``; its JSON answer."""
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stub: Callable[..., bytes] = channel.unary_unary(f"/{SERVICE}/{method}")
        answer: dict[str, Any] = json.loads(stub(body, timeout=timeout, metadata=((SECRET_HEADER, secret),)))
        return answer
