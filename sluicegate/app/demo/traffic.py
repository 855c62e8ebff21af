"""The demo's client: real images sent to the local model server over KServe V2 gRPC while a canary runs.

Requests carry ids ``demo-<n>``, so any of them can be traced with ``sluicegate lineage demo-<n>``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from serving.preprocessing import PreprocessSpec, preprocess
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc


@dataclass
class TrafficReport:
    sent: int = 0
    by_version: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    last_request_id: str = ""


def load_inputs(images: Sequence[Path], spec: PreprocessSpec, limit: int = 64) -> list[bytes]:
    """Up to ``limit`` images, preprocessed as the model expects, as raw FP32 [1, C, H, W] buffers."""
    chosen = [np.asarray(Image.open(path).convert("RGB")) for path in list(images)[:limit]]
    if not chosen:
        raise ValueError("the demo client needs at least one image to send")
    return [preprocess([image], spec).tobytes() for image in chosen]


class Traffic:
    """A client on a background thread sending ``rate`` requests per second, one at a time, until stopped.

    Paced rather than flat out: production traffic does not saturate the server, and on a small machine a
    flat-out client would starve the training run the demo is waiting for.
    """

    def __init__(
        self,
        target: str,
        model: str,
        inputs: list[bytes],
        spec: PreprocessSpec,
        rate: float = 100,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.report = TrafficReport()
        # The stack's server serves TLS when the rollout settings say so; its clients follow.
        self._channel = (
            grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
        )
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._model, self._inputs = model, inputs
        self._interval = 1.0 / rate
        self._shape = [1, spec.channels, spec.height, spec.width]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._channel.close()

    def snapshot(self) -> TrafficReport:
        with self._lock:
            return TrafficReport(
                self.report.sent, Counter(self.report.by_version), list(self.report.errors), self.report.last_request_id
            )

    def _run(self) -> None:
        tensor = pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=self._shape)
        index = 0
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + self._interval, time.monotonic() - 1.0)  # no burst after a stall
            request_id = f"demo-{index}"
            request = pb.ModelInferRequest(
                model_name=self._model,
                id=request_id,
                inputs=[tensor],
                raw_input_contents=[self._inputs[index % len(self._inputs)]],
            )
            index += 1
            try:
                response = self._stub.ModelInfer(request, timeout=10)
            except grpc.RpcError as exc:
                with self._lock:
                    self.report.sent += 1
                    self.report.errors.append(f"{request_id}: {exc.code().name} {exc.details()}")
                continue
            with self._lock:
                self.report.sent += 1
                self.report.by_version[response.model_version] += 1
                self.report.last_request_id = request_id
