"""The native reference: a C++ gRPC front end (``front.cc``) with Python called once per batch.

Issue 19 asks what a faster path than grpcio's Python layer per request reaches. This server answers it
with the same models, session settings and batch cap as the grpcio reference (``reference_server.py``):
grpc++'s callback server decodes and checks each ModelInfer (one FP32 input as ``raw_input_contents``)
and queues it in C++; one Python thread per model takes up to ``--max-batch`` queued rows as one numpy
array (the GIL released while it waits), runs ``session.run`` and hands the outputs back, and C++ answers
every request of the batch. So Python runs once per batch instead of once per request, and grpc's
threads never take the GIL.

It is a yardstick, not our server: no authentication, metrics, routing or load/unload. With
``--records FILE`` every request is recorded the way issue 19 asks of ours: C++ digests each input
(XXH3-128, the digest our request records carry) and ``take`` returns the batch's (id, digest, rows); a
writer thread appends them as JSON lines once per tick, so recording costs no per-request Python on the
request path. Binds 127.0.0.1 only; SIGTERM or SIGINT stops it. The module is built by ``build.py``
(``--module-dir``).

    python -m benchmarks.native_reference --module-dir DIR --port 9002 small=/tmp/models/small.onnx
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from benchmarks.reference_server import HOST, STOP_GRACE_S, make_session, parse_models

log = logging.getLogger("native_reference")


class RecordWriter:
    """Appends the records of each batch to a JSON-lines file from its own thread, one write per tick."""

    TICK_S = 0.2

    def __init__(self, path: Path) -> None:
        self._queue: queue.SimpleQueue[tuple[float, str, list[tuple[str, str, int]]] | None] = queue.SimpleQueue()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file: BinaryIO = os.fdopen(fd, "ab")
        self._thread = threading.Thread(target=self._write_forever, name="records", daemon=True)
        self._thread.start()

    def add(self, when: float, model: str, records: list[tuple[str, str, int]]) -> None:
        self._queue.put((when, model, records))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._file.close()

    def _write_forever(self) -> None:
        while True:
            items = [self._queue.get()]  # wait for the first, then take whatever else is queued
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._queue.get_nowait())
            lines = [
                orjson.dumps({"ts": when, "request_id": rid, "model": model, "input_digest": digest, "rows": rows})
                for when, model, records in (item for item in items if item is not None)
                for rid, digest, rows in records
            ]
            if lines:
                self._file.write(b"\n".join(lines) + b"\n")
                self._file.flush()
            if None in items:  # close(): everything added before it is written
                return
            time.sleep(self.TICK_S)


def batch_forever(front: Any, index: int, session: Any, name: str, writer: RecordWriter | None) -> None:
    """Take a batch, run it, answer it, hand its records to the writer; until ``take`` says stop."""
    input_name, output_name = session.get_inputs()[0].name, session.get_outputs()[0].name
    while (taken := front.take(index)) is not None:
        rows, batch, records = taken
        if writer is not None and records is not None:
            writer.add(time.time(), name, records)
        try:
            outputs = session.run([output_name], {input_name: rows})[0]
        except Exception as exc:  # ONNX Runtime refused the batch: its requests get INTERNAL, the loop goes on
            log.warning("model %s: batch of %d rows failed: %s", name, len(rows), exc)
            front.fail(batch, f"{type(exc).__name__}: {exc}")
            continue
        front.finish(batch, outputs)


def row_shape(dims: list[Any], what: str) -> list[int]:
    if not all(isinstance(dim, int) and dim > 0 for dim in dims):
        raise SystemExit(f"{what}: every dimension but the batch must be fixed, got {dims}")
    return list(dims)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=PATH", help="ONNX models to serve, version 1 each")
    parser.add_argument("--port", type=int, required=True, help=f"gRPC port on {HOST}")
    parser.add_argument("--max-batch", type=int, default=8, help="most rows per session.run (the bench's cap)")
    parser.add_argument("--module-dir", type=Path, required=True, help="where build.py put the module")
    parser.add_argument("--records", type=Path, help="record every request (id, input digest) as JSON lines here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(args.module_dir))
    front = importlib.import_module("native_front")
    threads = int(os.environ.get("PEERBENCH_ORT_THREADS", "1"))  # the peers' knob, as in the reference
    # Blocked before any thread starts (grpc's too), so only sigwait below receives them.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    writer = RecordWriter(args.records) if args.records else None
    batchers = []
    for name, path in parse_models(args.models).items():
        session = make_session(path, threads)
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1 or inputs[0].type != "tensor(float)":
            raise SystemExit(f"model {name}: the native reference serves one float input and one output")
        index = front.add_model(
            name,
            inputs[0].name,
            row_shape(inputs[0].shape[1:], f"model {name} input"),
            outputs[0].name,
            row_shape(outputs[0].shape[1:], f"model {name} output"),
            args.max_batch,
        )
        batcher = threading.Thread(
            target=batch_forever, args=(front, index, session, name, writer), name=f"batcher-{name}"
        )
        batcher.start()
        batchers.append(batcher)
    try:
        front.start(f"{HOST}:{args.port}", writer is not None)
    except OSError as exc:
        stop(front, batchers, 0.0, writer)
        raise SystemExit(f"cannot bind {HOST}:{args.port}: {exc}") from exc
    log.info("serving on %s:%d (native front end, ORT intra-op threads %d)", HOST, args.port, threads)
    signum = signal.sigwait({signal.SIGTERM, signal.SIGINT})
    log.info("signal %d: stopping", signum)
    stop(front, batchers, STOP_GRACE_S, writer)
    log.info("stopped")


def stop(front: Any, batchers: list[threading.Thread], grace_s: float, writer: RecordWriter | None) -> None:
    """Refuse new calls, answer those in flight within ``grace_s``, let every batcher return, write the
    last records."""
    front.stop(grace_s)
    for batcher in batchers:
        batcher.join()
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
