"""The native reference (benchmarks/native_reference): built from source, served on a real socket, answers
checked against ONNX Runtime in process, bad requests refused, stopped cleanly by SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from benchmarks.native_reference.build import BuildUnavailable, build
from serving.observability.logs import raw_digest
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pbg
from tasks.conversion import export_onnx
from tests.fixtures.models import resnet
from tests.fixtures.services import free_port

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (3, 32, 32)
READY_S = 60.0


@dataclass
class Native:
    stub: pbg.GRPCInferenceServiceStub
    process: subprocess.Popen[bytes]
    session: ort.InferenceSession


@dataclass(frozen=True)
class Built:
    work: Path
    model: Path
    module_dir: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """A small exported model, and the front end built from source (~30 s, once per module)."""
    work = tmp_path_factory.mktemp("native")
    model = work / "model.onnx"
    export_onnx(resnet(1), np.zeros((1, *SHAPE), dtype=np.float32), model)
    return Built(work, model, build(work / "cache"))


@contextlib.contextmanager
def serving(built: Built, records: Path | None = None) -> Iterator[Native]:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.native_reference", "--port", str(port)]
    argv += ["--module-dir", str(built.module_dir), "--max-batch", "8", f"pcb={built.model}"]
    argv += ["--records", str(records)] if records else []
    with (built.work / f"native-{port}.log").open("wb") as log:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=READY_S)
        stub = pbg.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        yield Native(stub, process, ort.InferenceSession(str(built.model)))
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def native(built: Built) -> Iterator[Native]:
    with serving(built, built.work / "records.jsonl") as running:
        yield running


def infer(
    stub: pbg.GRPCInferenceServiceStub, rows: np.ndarray, *, shape: list[int] | None = None, request_id: str = "r1"
) -> np.ndarray:
    request = pb.ModelInferRequest(model_name="pcb", id=request_id)
    request.inputs.add(name="input", datatype="FP32", shape=shape or list(rows.shape))
    request.raw_input_contents.append(rows.astype(np.float32).tobytes())
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == request_id and response.model_name == "pcb"
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(tuple(response.outputs[0].shape))


def expected(session: ort.InferenceSession, rows: np.ndarray) -> np.ndarray:
    out: np.ndarray = session.run(None, {session.get_inputs()[0].name: rows})[0]
    return out


def test_answers_match_onnx_runtime_alone_and_in_batches(native: Native) -> None:
    rng = np.random.default_rng(0)
    three = rng.random((3, *SHAPE), dtype=np.float32)
    np.testing.assert_allclose(infer(native.stub, three), expected(native.session, three), rtol=1e-5, atol=1e-5)

    # 32 requests at once are batched together in C++; each still gets its own rows back.
    singles = [rng.random((1, *SHAPE), dtype=np.float32) for _ in range(32)]
    with futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda rows: infer(native.stub, rows), singles))
    for rows, answer in zip(singles, answers, strict=True):
        np.testing.assert_allclose(answer, expected(native.session, rows), rtol=1e-5, atol=1e-5)


def test_every_request_is_recorded_with_the_digest_our_records_carry(native: Native, built: Built) -> None:
    rng = np.random.default_rng(1)
    sent = {f"rec-{i}": rng.random((1 + i % 3, *SHAPE), dtype=np.float32) for i in range(24)}
    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: infer(native.stub, item[1], request_id=item[0]), sent.items()))

    found: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 10
    while set(sent) - set(found) and time.monotonic() < deadline:
        time.sleep(0.2)  # the writer appends once per tick
        lines = (built.work / "records.jsonl").read_bytes().splitlines()
        found = {str(r["request_id"]): r for r in map(json.loads, lines) if str(r["request_id"]) in sent}

    assert set(found) == set(sent)
    for request_id, rows in sent.items():
        assert found[request_id]["input_digest"] == raw_digest([rows.tobytes()])  # what lineage looks up
        assert found[request_id]["rows"] == len(rows) and found[request_id]["model"] == "pcb"


def test_metadata_describes_the_model(native: Native) -> None:
    meta = native.stub.ModelMetadata(pb.ModelMetadataRequest(name="pcb"), timeout=10)

    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("input", "FP32", [-1, *SHAPE])]
    assert native.stub.ModelReady(pb.ModelReadyRequest(name="pcb"), timeout=10).ready
    assert not native.stub.ModelReady(pb.ModelReadyRequest(name="other"), timeout=10).ready


@pytest.mark.parametrize(
    ("shape", "rows", "code"),
    [
        ([1, 3, 32, 31], 1, grpc.StatusCode.INVALID_ARGUMENT),  # not the model's row shape
        ([9, *SHAPE], 9, grpc.StatusCode.INVALID_ARGUMENT),  # more rows than the batch cap
        ([2, *SHAPE], 1, grpc.StatusCode.INVALID_ARGUMENT),  # the bytes are one row, the shape says two
    ],
)
def test_bad_requests_are_refused_and_the_server_carries_on(
    native: Native, shape: list[int], rows: int, code: grpc.StatusCode
) -> None:
    data = np.zeros((rows, *SHAPE), dtype=np.float32)
    with pytest.raises(grpc.RpcError) as refused:
        infer(native.stub, data, shape=shape)

    assert refused.value.code() == code
    assert infer(native.stub, np.zeros((1, *SHAPE), dtype=np.float32)).shape == (1, 4)


def test_an_unknown_model_is_not_found(native: Native) -> None:
    request = pb.ModelInferRequest(model_name="nope")
    with pytest.raises(grpc.RpcError) as refused:
        native.stub.ModelInfer(request, timeout=10)

    assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_sigterm_stops_it_cleanly(built: Built) -> None:
    with serving(built) as own:
        assert infer(own.stub, np.zeros((2, *SHAPE), dtype=np.float32)).shape == (2, 4)
        own.process.send_signal(signal.SIGTERM)

        assert own.process.wait(timeout=20) == 0


def test_without_the_tools_the_build_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, protoc, pkg-config or apt-get

    with pytest.raises(BuildUnavailable, match=r"apt-get install .*libgrpc\+\+-dev"):
        build(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_cached_module_others_could_have_written_is_refused(built: Built) -> None:
    folder = built.module_dir
    folder.chmod(0o777)
    try:
        with pytest.raises(BuildUnavailable, match="writable by others"):
            build(folder.parent)
    finally:
        folder.chmod(0o755)
    assert build(folder.parent) == folder  # trusted again: the same cached build, not a new one
