"""The gRPC port on the native front end (serving/native): grpc++ owns the public port; the grpcio server
of serving/grpc_api/server.py listens on a private Unix socket behind it.

The common ModelInfer (what ``fast_infer.InputPlan`` accepts, for a version whose inputs have fixed
shapes, with tracing off) waits on a *lane*, one per (model, requested version), in C++. One thread per
lane takes a batch, routes each request by the traffic weights (as the grpcio path does, per request),
runs each version's rows once through its batcher (so fallbacks, monitors, statistics and the batch
metrics are those of every other request), and hands the answers back to C++; then, still per batch,
it counts each request in the request metrics and queues its record (digest computed in C++) for the
telemetry thread. Everything else is proxied to the grpcio server, which answers it as it always has.

Lanes follow the data plane: rebuilt on every load, unload and runtime change (the readiness hook).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from serving.batching import signature
from serving.dataplane import DataPlane, LoadedVersion
from serving.errors import DETAILS_CHARS, ModelNotReady, ServingError, clip
from serving.observability.logs import LaneBatch
from serving.observability.metrics import ServerMetrics
from serving.types import DATATYPES

log = logging.getLogger(__name__)

INTERNAL = 13  # grpc.StatusCode.INTERNAL's number; this module needs no grpc import
INTERNAL_DETAILS = "internal error in /inference.GRPCInferenceService/ModelInfer; see the server log"
PRIVATE_PREFIX = "sluicegate-grpc-"  # the private socket's folder, in the temp dir
STALE_AFTER_S = 60.0  # a folder younger than this may belong to a server still starting: never removed


@dataclass(frozen=True)
class LaneSpec:
    """What a lane accepts: the inputs (name, datatype, non-batch shape), the outputs (name, datatype),
    in the model's order, and the batch and queue caps."""

    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, str], ...]
    max_batch: int
    max_queue: int


def lane_spec(loaded: LoadedVersion) -> LaneSpec | None:
    """The lane of a version whose requests can all take it, or None (free dimensions, BYTES)."""
    inputs = []
    for name, (datatype, shape) in loaded.inputs.items():
        if datatype == "BYTES" or datatype not in DATATYPES or len(shape) < 1 or any(d < 0 for d in shape[1:]):
            return None
        inputs.append((name, datatype, tuple(shape[1:])))
    if not inputs:
        return None
    max_queue = int(loaded.config.to_dict()["batching"]["max_queue_size"])
    return LaneSpec(tuple(inputs), tuple(loaded.outputs.items()), loaded.max_batch_size, max_queue)


def wanted_lanes(versions: dict[str, dict[str, LoadedVersion]]) -> dict[tuple[str, str], LaneSpec]:
    """(model, version) -> spec for every loaded version, and (model, "") where every version of the model
    has the same inputs and outputs (the weights may route a request to any of them)."""
    lanes: dict[tuple[str, str], LaneSpec] = {}
    for model, by_version in versions.items():
        specs = {version: lane_spec(loaded) for version, loaded in by_version.items()}
        for version, spec in specs.items():
            if spec is not None:
                lanes[(model, version)] = spec
        shared = {(s.inputs, s.outputs) if s else None for s in specs.values()}
        if len(shared) == 1 and None not in shared:
            every = [s for s in specs.values() if s is not None]
            lanes[(model, "")] = LaneSpec(
                every[0].inputs,
                every[0].outputs,
                min(s.max_batch for s in every),
                min(s.max_queue for s in every),
            )
    return lanes


class _Lane:
    __slots__ = ("id", "inline", "model", "names", "spec", "thread", "version")

    def __init__(self, lane_id: int, model: str, version: str, spec: LaneSpec) -> None:
        self.id, self.model, self.version, self.spec = lane_id, model, version, spec
        self.names = [name for name, _, _ in spec.inputs]
        self.thread: threading.Thread | None = None
        # Its batches run on the lane thread (no hand-off), which then waits for them: only where every
        # request of the lane goes to one version. A lane shared by several versions (a canary) hands each
        # version's rows to that version's batcher and goes on taking: a slow version must not hold up the
        # others' requests (a canary that queues 40 ms per request made stable just as slow).
        self.inline = True


def remove_stale_folders(root: Path, *, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the private-socket folders in ``root`` that no server uses any more; the removed ones.

    ``NativePort.stop`` removes its own folder, but a server killed outright (SIGKILL, the OOM killer, a
    supervisor replacing a hung worker) cannot, and a pod's emptyDir /tmp outlives its container's
    restarts. So each server removes what dead ones left, at start-up: folders of this user, last changed
    ``older_than_s`` ago or earlier (a server may be between creating its folder and listening), whose
    socket refuses connections or is missing. Connecting asks the listener itself, so a server of another
    PID namespace sharing this /tmp is left alone; anything else unexpected (no permission, a full
    backlog) leaves the folder too. Errors are logged, never raised: this must not stop a server starting.
    """
    removed: list[Path] = []
    try:
        found = sorted(root.glob(PRIVATE_PREFIX + "*"))
    except OSError as exc:
        log.warning("cannot list %s for stale private sockets: %s", root, exc)
        return removed
    uid, cutoff = os.getuid(), time.time() - older_than_s
    for folder in found:
        try:
            info = folder.lstat()
            if not folder.is_dir() or folder.is_symlink() or info.st_uid != uid or info.st_mtime > cutoff:
                continue
            if _listening(folder / "grpc.sock"):
                continue
            shutil.rmtree(folder)
            removed.append(folder)
        except FileNotFoundError:
            continue  # a worker starting beside this one (same supervisor) removed it first
        except OSError as exc:
            log.warning("left %s: %s", folder, exc)
    if removed:
        log.info("removed %d private socket folder(s) of servers that are gone, in %s", len(removed), root)
    return removed


def _listening(path: Path) -> bool:
    """Whether a server accepts on the Unix socket ``path``; False only when nobody can (refused, missing)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # a full backlog, a timeout, no permission: somebody may well be there
    finally:
        probe.close()
    return True


class NativePort:
    """The public gRPC port served by the native front end, with ``grpc_server`` (not started) behind it.

    Quacks like ``grpc.Server`` where serving/server.py uses one: ``start()`` and ``stop(grace)``.
    """

    def __init__(
        self,
        native: ModuleType,
        grpc_server: Any,
        plane: DataPlane,
        metrics: ServerMetrics,
        *,
        max_elements: int,
        request_log: Any,
    ) -> None:
        self._native, self._grpc, self.plane, self.metrics = native, grpc_server, plane, metrics
        self.max_elements = max_elements
        self.request_log = request_log
        telemetry = plane.telemetry
        # Spans are opened by the grpcio servicer per request: with tracing on, every call goes there.
        self.lanes_enabled = telemetry is None or telemetry.tracing is None
        remove_stale_folders(Path(tempfile.gettempdir()))
        self._folder = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))  # 0700: only this user may connect
        self.socket = self._folder / "grpc.sock"
        self._front = native.create(f"unix:{self.socket}", request_log is not None)
        self._lanes: dict[tuple[str, str], _Lane] = {}
        self._sync_lock = threading.Lock()
        self._closed = False

    def bind(
        self, address: str, int_args: Sequence[tuple[str, int]], tls: tuple[bytes, bytes, bytes | None] | None
    ) -> int:
        """Start the private grpcio server, then bind and open the public port; the port, 0 if it is taken."""
        if self._grpc.add_insecure_port(f"unix:{self.socket}") == 0:
            raise SystemExit(f"cannot bind the private gRPC socket {self.socket}")
        self._grpc.start()
        port = int(self._native.start(self._front, address, list(int_args), tls))
        if port == 0:
            self._grpc.stop(0)
            shutil.rmtree(self._folder, ignore_errors=True)
        return port

    def start(self) -> None:
        """Both servers already run (``bind``): the port answers liveness while models load."""

    def counts(self) -> tuple[int, int]:
        """(requests answered from a lane, calls passed to the grpcio server) so far."""
        fast, proxied = self._native.counts(self._front)
        return int(fast), int(proxied)

    # -- lanes ---------------------------------------------------------------------------------------

    def sync(self, _ready: bool = False) -> None:
        """Make the lanes match the loaded versions (the data plane's readiness hook: every change)."""
        if not self.lanes_enabled:
            return
        with self._sync_lock:
            if self._closed:
                return
            versions = self.plane.versions()
            wanted = wanted_lanes(versions)
            for key, lane in list(self._lanes.items()):
                if wanted.get(key) != lane.spec:
                    self._native.close_lane(self._front, lane.id)  # its thread drains it and ends
                    del self._lanes[key]
            for key, spec in wanted.items():
                if key not in self._lanes:
                    self._lanes[key] = self._open(key[0], key[1], spec)
            for (model, version), lane in self._lanes.items():
                lane.inline = bool(version) or len(versions.get(model, ())) <= 1

    def _open(self, model: str, version: str, spec: LaneSpec) -> _Lane:
        inputs = [
            (name, datatype, tail, DATATYPES[datatype].num, DATATYPES[datatype].itemsize)
            for name, datatype, tail in spec.inputs
        ]
        outputs = [name for name, _ in spec.outputs]
        lane_id = self._native.add_lane(
            self._front, model, version, inputs, outputs, spec.max_batch, spec.max_queue, self.max_elements
        )
        lane = _Lane(int(lane_id), model, version, spec)
        lane.thread = threading.Thread(target=self._serve, args=(lane,), name=f"lane-{model}/{version}", daemon=True)
        lane.thread.start()
        return lane

    def _serve(self, lane: _Lane) -> None:
        take, front = self._native.take, self._front
        spares: list[Any] = [None] * len(lane.spec.inputs)  # take()'s reusable batch buffers, one per input
        while (got := take(front, lane.id, spares)) is not None:
            batch, arrays, items, gone = got
            del got  # with `arrays` (below): take() reuses a spare only when no view of it is left
            try:
                if gone:
                    self._gone(lane, gone)
                if batch is not None:
                    self._batch(lane, batch, arrays, items)
            except Exception:
                log.exception("lane %s/%s failed a batch", lane.model, lane.version)
                if batch is not None:
                    # Answered here, not left to the capsule's destructor: the logged traceback keeps the
                    # batch alive (a log handler holding the record, e.g. pytest's), and a call never
                    # finished holds grpc++'s Shutdown for ever (CI: a rollout test's 600 s timeout).
                    # Those a version's batcher thread answers at this moment were claimed under the GIL
                    # (front.cc answer()): refuse() skips them.
                    self._native.refuse(batch, range(len(items)), INTERNAL, INTERNAL_DETAILS)
            finally:
                del arrays

    def _gone(self, lane: _Lane, gone: list[tuple[str, str, int, float]]) -> None:
        """Requests whose callers stopped waiting before their batch ran: counted, recorded, never run."""
        try:
            version = self.plane.route(lane.model, lane.version).version
        except ServingError:
            version = lane.version
        items = [(request_id, None, rows, received, None) for request_id, _, rows, received in gone]
        for k, (_, code, _, _) in enumerate(gone):
            self._account(lane, items, [k], None, code, None, None, version)

    def _batch(self, lane: _Lane, batch: Any, arrays: list[np.ndarray], items: list[tuple[Any, ...]]) -> None:
        """Route each request, run each version's rows once, answer, then count and record each request."""
        count = len(items)
        try:
            if lane.version or count == 1:
                loaded = self.plane.route(lane.model, lane.version)
                groups = {id(loaded): (loaded, list(range(count)))}
            else:
                groups = {}
                for k in range(count):
                    loaded = self.plane.route(lane.model)
                    groups.setdefault(id(loaded), (loaded, []))[1].append(k)
        except ServingError as exc:
            self._refuse(lane, batch, list(range(count)), items, lane.version, exc)
            return
        offsets = list(accumulate((item[2] for item in items), initial=0))  # row where each request starts
        for loaded, indices in groups.values():
            self._run(lane, batch, arrays, items, offsets, loaded, indices)

    def _run(
        self,
        lane: _Lane,
        batch: Any,
        arrays: list[np.ndarray],
        items: list[tuple[Any, ...]],
        offsets: list[int],
        loaded: LoadedVersion,
        indices: list[int],
    ) -> None:
        # Read once: sync() may flip it from another thread while this batch runs (CI: read twice, a
        # canary loaded in between left an inline batch on the hand-off path, and its callers unanswered).
        inline = lane.inline
        try:
            if len(indices) == len(items):
                inputs = dict(zip(lane.names, arrays, strict=True))
            else:
                rows_of = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in indices])
                inputs = {name: array[rows_of] for name, array in zip(lane.names, arrays, strict=True)}
            rows = int(sum(items[k][2] for k in indices))
            sig = signature(inputs)
            for attempt in (0, 1):
                try:
                    if inline:
                        outputs = self.plane.run(loaded, inputs, rows, sig, count=len(indices), batched=True)
                    else:
                        queued = loaded.batcher.submit(inputs, count=len(indices))
                    break
                except ModelNotReady:
                    # Being unloaded between routing and queueing: choose again, once, unless the caller
                    # asked for that very version (the grpcio path's rule).
                    if attempt or lane.version:
                        raise
                    loaded = self.plane.route(lane.model)
        except Exception as exc:
            self._failed(lane, batch, indices, items, loaded, exc)
            return
        if inline:
            self._answer(lane, batch, items, indices, loaded, outputs)  # raising: _serve refuses the rest
            return
        chosen = loaded

        def done(future: Future[dict[str, np.ndarray]]) -> None:  # on the version's batcher thread
            error = future.exception()
            if error is None:
                try:
                    self._answer(lane, batch, items, indices, chosen, future.result())
                    return
                except Exception as exc:  # nobody above this thread would answer its callers
                    error = exc
            self._failed(lane, batch, indices, items, chosen, error)

        queued.add_done_callback(done)

    def _failed(
        self,
        lane: _Lane,
        batch: Any,
        indices: list[int],
        items: list[tuple[Any, ...]],
        loaded: LoadedVersion,
        exc: BaseException,
    ) -> None:
        if not isinstance(exc, ServingError):
            log.error("/inference.GRPCInferenceService/ModelInfer failed", exc_info=exc)
        self._refuse(lane, batch, indices, items, loaded.version, exc)

    def _answer(
        self,
        lane: _Lane,
        batch: Any,
        items: list[tuple[Any, ...]],
        indices: list[int],
        loaded: LoadedVersion,
        outputs: dict[str, np.ndarray],
    ) -> None:
        """Hand the outputs to C++ for the callers of ``indices``, then count and record them."""
        runtime = str(loaded.runtime.level_name)
        wire = [
            (name, datatype, np.ascontiguousarray(outputs[name], dtype=DATATYPES[datatype].newbyteorder("<")))
            for name, datatype in lane.spec.outputs
        ]
        # "abnormal": the rules runtime's answer is not the model's (the grpcio path sets it the same way).
        late = self._native.answer(batch, indices, loaded.version, wire, runtime == "rules")
        logits = wire[0][2] if wire else None
        self._account(lane, items, indices, loaded, "OK", runtime, logits, late=late)

    def _refuse(
        self,
        lane: _Lane,
        batch: Any,
        indices: list[int],
        items: list[tuple[Any, ...]],
        version: str,
        exc: BaseException,
    ) -> None:
        if isinstance(exc, ServingError):
            code, details, name = exc.code.value[0], clip(str(exc), DETAILS_CHARS), exc.code.name
        else:
            code, details, name = INTERNAL, INTERNAL_DETAILS, "INTERNAL"
        self._native.refuse(batch, indices, code, details)
        self._account(lane, items, indices, None, name, None, None, version)

    def _account(
        self,
        lane: _Lane,
        items: list[tuple[Any, ...]],
        indices: list[int],
        loaded: LoadedVersion | None,
        code: str,
        runtime: str | None,
        logits: np.ndarray | None,
        version: str = "",
        late: dict[int, str] | None = None,
    ) -> None:
        """Each request's metrics, as serving/grpc_api/servicer.py counts them, and the requests' records
        in one ``LaneBatch`` (expanded into lines on the telemetry thread); ``late``: the requests (by
        index in ``items``) answered after their callers stopped waiting, and what those callers saw."""
        now = time.perf_counter()
        version = loaded.version if loaded is not None else (version or lane.version)
        observe, model = self.metrics.observe, lane.model
        for k in indices:
            observe(model, version, late.get(k, code) if late else code, now - items[k][3])
        if self.request_log is not None:
            requests = [items[k] for k in indices]
            moved = {position: late[k] for position, k in enumerate(indices) if k in late} if late else None
            monitors = loaded.monitors if loaded is not None else None
            self.request_log.record_batch(
                LaneBatch(time.time(), model, version, runtime, code, requests, logits, monitors, moved, now)
            )

    # -- shutdown ------------------------------------------------------------------------------------

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls now; in-flight ones (lanes and proxied) get ``grace`` seconds; the event is set
        once both servers stopped."""
        done = threading.Event()

        def run() -> None:
            try:
                self._native.shutdown(self._front, float(grace or 0.0))
                with self._sync_lock:
                    self._closed = True
                    lanes = list(self._lanes.values())
                    self._lanes.clear()
                for lane in lanes:
                    self._native.close_lane(self._front, lane.id)
                for lane in lanes:
                    if lane.thread is not None:
                        lane.thread.join(timeout=5.0)
                self._grpc.stop(0).wait()
            finally:
                shutil.rmtree(self._folder, ignore_errors=True)
                done.set()

        threading.Thread(target=run, name="native-front-stop", daemon=True).start()
        return done
