"""A minimal KServe V2 gRPC server with a dynamic batcher: what grpcio itself allows on this machine.

The serving benchmark measures it beside our server in every repeat, pinned and loaded the same way, so
our throughput and latency can be judged against a same-run reference instead of against absolute
figures from another day (the VM's speed moves by ±20% between runs minutes apart). It does the least a
V2 server can do and stay correct, so it is an upper bound for servers built the same way (synchronous
``grpc.server``, Python handlers, one ONNX Runtime session per model):

- ``ModelInfer`` decodes ``raw_input_contents`` with ``np.frombuffer`` (FP32 only, no copy), queues the
  array for the model's batcher thread and waits on a lock; the batcher takes what is queued, up to
  ``--max-batch`` rows, runs one ``session.run`` and hands each request its slice; the answer goes back as
  ``raw_output_contents``. No validation beyond what correctness needs, no metrics, no logs.
- ONNX Runtime settings are the peers' (``shared/bench/peers/ort_session.py``): intra-op threads from
  ``PEERBENCH_ORT_THREADS`` (default 1), inter-op 1, ``ORT_SEQUENTIAL``, ``ORT_ENABLE_ALL``, CPU EP.
- ServerLive, ServerReady, ModelReady, ModelMetadata and ModelInfer; everything else is UNIMPLEMENTED.
  Binds 127.0.0.1 only. Models load before the port opens, so an accepted connection means ready.
  SIGTERM (or SIGINT) stops it.

It imports the generated V2 stubs from ``serving.proto`` and nothing else of ``serving``: it must not
share code with the server it is the reference for.

    python -m benchmarks.reference_server --port 9001 small=/tmp/models/small.onnx medium=/tmp/models/medium.onnx
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import grpc
import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pbg

log = logging.getLogger("reference_server")

HOST = "127.0.0.1"
MAX_MESSAGE_BYTES = 100 * 1024 * 1024  # our server's default, so a large medium batch is not refused here only
STOP_GRACE_S = 5.0
ORT_TYPES = {"tensor(float)": "FP32"}  # the only type the bench models use, and the only one decoded here

FloatArray = npt.NDArray[np.float32]


def make_session(path: Path, intra_op_threads: int) -> Any:
    """An ONNX Runtime session with the peers' settings (shared/bench/peers/ort_session.py)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


@dataclass
class Slot:
    """One request waiting for its rows: the batcher releases ``done`` once ``output`` or ``error`` is set.

    A plain lock, acquired at creation, is the cheapest one-shot hand-off between two threads in CPython
    (an Event or a Future wraps a Condition around one)."""

    rows: FloatArray
    done: threading.Lock = field(default_factory=threading.Lock)
    output: FloatArray | None = None
    error: Exception | None = None

    def __post_init__(self) -> None:
        self.done.acquire()


class Model:
    """One ONNX model behind a dynamic batcher thread."""

    def __init__(self, name: str, path: Path, *, max_batch: int, intra_op_threads: int) -> None:
        self.name, self.max_batch = name, max_batch
        self.session = make_session(path, intra_op_threads)
        self.input, self.output = self.session.get_inputs()[0], self.session.get_outputs()[0]
        # Checked per request, so one bad request cannot fail the good ones batched with it (None: any size).
        self.row_shape = tuple(dim if isinstance(dim, int) else None for dim in self.input.shape[1:])
        self._queue: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        threading.Thread(target=self._batch_forever, name=f"batcher-{name}", daemon=True).start()

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """A batch of 1..max_batch rows of the model's row shape."""
        if len(shape) != len(self.row_shape) + 1 or not 1 <= shape[0] <= self.max_batch:
            return False
        return all(want is None or got == want for got, want in zip(shape[1:], self.row_shape, strict=True))

    def infer(self, rows: FloatArray) -> FloatArray:
        slot = Slot(rows)
        self._queue.put(slot)
        slot.done.acquire()
        if slot.error is not None:
            raise slot.error
        assert slot.output is not None  # set by the batcher before it released the slot
        return slot.output

    def _batch_forever(self) -> None:
        held: Slot | None = None  # a request that did not fit in the previous batch goes first in the next
        while True:
            slots = [held if held is not None else self._queue.get()]
            held = None
            rows = len(slots[0].rows)
            while rows < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if rows + len(nxt.rows) > self.max_batch:
                    held = nxt
                    break
                slots.append(nxt)
                rows += len(nxt.rows)
            self._run(slots)

    def _run(self, slots: list[Slot]) -> None:
        try:
            batch = slots[0].rows if len(slots) == 1 else np.concatenate([s.rows for s in slots])
            outputs = self.session.run([self.output.name], {self.input.name: batch})[0]
        except Exception as exc:  # every waiting request gets the error; the batcher carries on
            for slot in slots:
                slot.error = exc
                slot.done.release()
            return
        start = 0
        for slot in slots:
            slot.output = outputs[start : start + len(slot.rows)]
            start += len(slot.rows)
            slot.done.release()

    def metadata(self) -> Any:
        def tensor(meta: Any) -> Any:
            shape = [dim if isinstance(dim, int) else -1 for dim in meta.shape]  # symbolic batch axis: -1
            datatype = ORT_TYPES.get(meta.type, meta.type)
            return pb.ModelMetadataResponse.TensorMetadata(name=meta.name, datatype=datatype, shape=shape)

        return pb.ModelMetadataResponse(
            name=self.name,
            versions=["1"],
            platform="onnxruntime_onnx",
            inputs=[tensor(self.input)],
            outputs=[tensor(self.output)],
        )


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("unreachable: grpc's abort raises")  # says so to the type checker (grpc is untyped)


class ReferenceServicer(pbg.GRPCInferenceServiceServicer):
    def __init__(self, models: dict[str, Model]) -> None:
        self.models = models

    def ServerLive(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=True)  # models load before the port opens

    def ModelReady(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ModelReadyResponse(ready=request.name in self.models)

    def ModelMetadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._model(request.name, context).metadata()

    def ModelInfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._model(request.model_name, context)
        if len(request.inputs) != 1 or len(request.raw_input_contents) != 1 or request.inputs[0].datatype != "FP32":
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "one FP32 input as raw_input_contents, please")
        tensor = request.inputs[0]
        try:
            rows = np.frombuffer(request.raw_input_contents[0], dtype=np.float32).reshape(tuple(tensor.shape))
        except ValueError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"input {tensor.name!r}: {exc}")
        if not model.accepts(rows.shape):
            wanted = ", ".join("-1" if dim is None else str(dim) for dim in model.row_shape)
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input shape {list(rows.shape)}, expected [1..{model.max_batch}, {wanted}]",
            )
        try:
            outputs = model.infer(rows)
        except Exception as exc:  # ONNX Runtime refused the input (wrong shape, ...)
            abort(context, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        response = pb.ModelInferResponse(model_name=model.name, model_version="1", id=request.id)
        response.outputs.add(name=model.output.name, datatype="FP32", shape=outputs.shape)
        response.raw_output_contents.append(outputs.tobytes())
        return response

    def _model(self, name: str, context: grpc.ServicerContext) -> Model:
        model = self.models.get(name)
        if model is None:
            abort(context, grpc.StatusCode.NOT_FOUND, f"no model {name!r}; serving {sorted(self.models)}")
        return model


def parse_models(specs: list[str]) -> dict[str, Path]:
    models: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            raise SystemExit(f"model {spec!r}: expected NAME=PATH to an existing .onnx file")
        models[name] = Path(path)
    return models


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="NAME=PATH", help="ONNX models to serve, version 1 each")
    parser.add_argument("--port", type=int, required=True, help=f"gRPC port on {HOST}")
    parser.add_argument("--max-batch", type=int, default=8, help="most rows per session.run (the bench's cap)")
    parser.add_argument("--workers", type=int, default=64, help="gRPC handler threads (our server's default)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = int(os.environ.get("PEERBENCH_ORT_THREADS", "1"))  # the peers' knob, read once here
    models = {
        name: Model(name, path, max_batch=args.max_batch, intra_op_threads=threads)
        for name, path in parse_models(args.models).items()
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a stale server on the port must fail the start, not share it
        ],
    )
    pbg.add_GRPCInferenceServiceServicer_to_server(ReferenceServicer(models), server)  # type: ignore[no-untyped-call]
    if server.add_insecure_port(f"{HOST}:{args.port}") == 0:
        raise SystemExit(f"cannot bind {HOST}:{args.port}")

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        server.stop(STOP_GRACE_S)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.start()
    log.info("serving %s on %s:%d (ORT intra-op threads %d)", ", ".join(models), HOST, args.port, threads)
    server.wait_for_termination()
    log.info("stopped")


if __name__ == "__main__":
    main()
