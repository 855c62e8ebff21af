"""The native gRPC front end (serving/native) in front of the grpcio server: the common ModelInfer is
answered from a lane (batched in C++, Python once per batch), everything else is passed to the grpcio
server with the caller's metadata and address, and the answers are the same either way.

Every other gRPC test of the server runs through this front end too (``native_front=auto``, built by
``make test``); these check what is particular to it."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from serving.grpc_api.native_port import NativePort, wanted_lanes
from serving.grpc_api.server import native_front
from serving.native import HERE, load
from serving.native.build import FRONT_MODULE
from serving.observability.logs import raw_digest
from serving.proto import admin_pb2, admin_pb2_grpc, grpc_service_pb2_grpc
from serving.proto import grpc_service_pb2 as pb
from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.serving.conftest import MODEL, batch

ADMIN = [("authorization", "Bearer s3cret")]


def reference(repo: Path, version: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / MODEL / version / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def raw_request(x: np.ndarray, version: str = "", request_id: str = "") -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=MODEL, model_version=version, id=request_id)
    msg.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    msg.raw_input_contents.append(x.tobytes())
    return msg


def logits(answer: pb.ModelInferResponse) -> np.ndarray:
    out = answer.outputs[0]
    return np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(tuple(out.shape))


@pytest.fixture(scope="module")
def front(server: RunningServer) -> NativePort:
    assert isinstance(server.grpc_server, NativePort), "make test builds serving/native; the server must use it"
    return server.grpc_server


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> grpc_service_pb2_grpc.GRPCInferenceServiceStub:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    return grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_the_module_is_built_and_loads() -> None:
    module, why = load()
    assert module is not None, why


def test_an_unbuilt_or_stale_module_is_not_loaded_and_says_why(tmp_path: Path) -> None:
    module, why = load(tmp_path)
    assert module is None and "python -m serving.native.build" in why
    built = next(HERE.glob(f"{FRONT_MODULE}.*.so"))
    shutil.copy(built, tmp_path / built.name)
    (tmp_path / f"{FRONT_MODULE}.key").write_text("0123456789abcdef\n")
    module, why = load(tmp_path)
    assert module is None and "rebuild" in why


def test_without_the_module_native_front_on_refuses_to_start_and_auto_falls_back(tmp_path: Path) -> None:
    empty = tmp_path / "unbuilt"  # nothing built there
    empty.mkdir()
    on = ServingSettings(repository=str(tmp_path), grpc_port=0, http_port=0, native_front="on")
    with pytest.raises(SystemExit, match=r"native_front=on.*python -m serving\.native\.build"):
        native_front(on, empty)
    assert native_front(on.model_copy(update={"native_front": "auto"}), empty) is None
    assert native_front(on.model_copy(update={"native_front": "off"})) is None
    assert native_front(on.model_copy(update={"native_front": "auto"})) is not None  # built by make test


def test_lanes_cover_fixed_shape_versions_and_models_whose_versions_agree(server: RunningServer) -> None:
    lanes = wanted_lanes(server.dataplane.versions())
    assert (MODEL, "1") in lanes and (MODEL, "2") in lanes and (MODEL, "") in lanes
    spec = lanes[(MODEL, "")]
    assert spec.inputs == (("input", "FP32", (3, 32, 32)),) and spec.max_batch == 8


def test_a_common_request_takes_a_lane_and_answers_like_onnx_runtime(
    front: NativePort, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, repo: Path
) -> None:
    x = batch(3, seed=21)
    fast_before, proxied_before = front.counts()
    answer = stub.ModelInfer(raw_request(x, version="1", request_id="native-1"))
    fast, proxied = front.counts()
    assert (fast - fast_before, proxied - proxied_before) == (1, 0)
    assert (answer.model_name, answer.model_version, answer.id) == (MODEL, "1", "native-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in answer.outputs] == [("logits", "FP32", [3, 4])]
    np.testing.assert_allclose(logits(answer), reference(repo, "1", x), rtol=1e-5, atol=1e-5)


def test_any_other_form_is_passed_to_grpcio_and_answers_the_same(
    front: NativePort, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    x = batch(2, seed=22)
    raw = stub.ModelInfer(raw_request(x, version="2"))
    typed = pb.ModelInferRequest(model_name=MODEL, model_version="2")
    tensor = typed.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    fast_before, proxied_before = front.counts()
    answer = stub.ModelInfer(typed)
    fast, proxied = front.counts()
    assert (fast - fast_before, proxied - proxied_before) == (0, 1)
    got = np.asarray(answer.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(tuple(answer.outputs[0].shape))
    np.testing.assert_allclose(got, logits(raw), rtol=1e-6, atol=1e-6)


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def raw_infer(server: RunningServer, wire: bytes) -> pb.ModelInferResponse:
    """A ModelInfer whose message bytes are sent as given (no serializer)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", response_deserializer=pb.ModelInferResponse.FromString
        )
        return call(wire, timeout=30)
    finally:
        channel.close()


def test_a_request_whose_fields_come_in_any_order_takes_the_lane_as_protobuf_reads_it(
    server: RunningServer, front: NativePort, repo: Path
) -> None:
    """The lane reads raw_input_contents where grpc received them and hands every other field to protobuf:
    inputs before the header, a field given twice (the last wins), an unknown field, an input large enough
    to arrive in several slices."""
    x = batch(8, seed=31)
    head = pb.ModelInferRequest(model_name=MODEL, model_version="1", id="any-order")
    head.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    wire = pb.ModelInferRequest(raw_input_contents=[x.tobytes()]).SerializeToString()
    wire += pb.ModelInferRequest(model_name="decoy", id="first").SerializeToString()
    wire += head.SerializeToString() + varint(99 << 3) + varint(5)  # field 99, a varint nobody defines
    assert pb.ModelInferRequest.FromString(wire).model_name == MODEL
    fast_before, proxied_before = front.counts()
    answer = raw_infer(server, wire)
    assert front.counts() == (fast_before + 1, proxied_before)
    assert (answer.model_name, answer.model_version, answer.id) == (MODEL, "1", "any-order")
    np.testing.assert_allclose(logits(answer), reference(repo, "1", x), rtol=1e-5, atol=1e-5)


def test_a_lane_reuses_its_batch_buffer_only_when_no_earlier_batch_is_held(
    front: NativePort, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, np.ndarray | None]] = []  # (buffer address, the array when held)
    hold = False
    run_batch = front._batch

    def spy(lane: Any, batch: Any, arrays: list[np.ndarray], items: list[Any]) -> None:
        address = arrays[0].__array_interface__["data"][0]
        seen.append((address, arrays[0] if hold else None))
        run_batch(lane, batch, arrays, items)

    monkeypatch.setattr(front, "_batch", spy)
    inputs = [batch(2, seed=400 + k) for k in range(8)]
    for x in inputs[:4]:  # one at a time: each is a batch of its own
        stub.ModelInfer(raw_request(x, version="1"))
    assert len({address for address, _ in seen}) == 1, "nothing held the last batch: its buffer is reused"
    hold, seen[:] = True, []
    for x in inputs[4:]:
        stub.ModelInfer(raw_request(x, version="1"))
    assert len({address for address, _ in seen}) == len(seen), "a held batch's buffer is never written again"
    for (_, held), x in zip(seen, inputs[4:], strict=True):
        np.testing.assert_array_equal(held, x)


@pytest.mark.parametrize(
    "tail",
    [
        varint(7 << 3) + varint(1),  # raw_input_contents sent as a varint: protobuf keeps it as unknown
        varint(7 << 3 | 2) + varint(65535) + b"abc",  # a length past the end of the message
        varint(7 << 3 | 3) + varint(7 << 3 | 4),  # a group, which this message never has
    ],
    ids=["wrong-wire-type", "truncated", "group"],
)
def test_a_request_the_lane_cannot_read_goes_to_the_grpcio_server(
    server: RunningServer, front: NativePort, tail: bytes
) -> None:
    x = batch(1, seed=32)
    wire = raw_request(x, version="1").SerializeToString() + tail
    fast_before, proxied_before = front.counts()
    try:
        answer = raw_infer(server, wire)  # what the grpcio server makes of it, whatever that is
    except grpc.RpcError as refused:
        assert refused.code() != grpc.StatusCode.OK
    else:
        assert answer.model_name == MODEL
    assert front.counts() == (fast_before, proxied_before + 1)
    assert raw_infer(server, raw_request(x, version="1").SerializeToString()).model_name == MODEL  # still serving


@pytest.mark.parametrize(
    ("mutate", "code", "words"),
    [
        (lambda r: setattr(r, "model_name", "absent"), grpc.StatusCode.NOT_FOUND, "absent"),
        (lambda r: r.inputs[0].shape.__setitem__(2, 31), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (lambda r: r.inputs[0].shape.__setitem__(0, 9), grpc.StatusCode.INVALID_ARGUMENT, "max_batch_size"),
        (lambda r: r.outputs.add(name="nope"), grpc.StatusCode.INVALID_ARGUMENT, "nope"),
    ],
)
def test_what_a_lane_does_not_take_gets_the_grpcio_servers_refusal(
    front: NativePort, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, mutate, code, words
) -> None:
    msg = raw_request(batch(9, seed=23)[:1], version="1")
    if words == "max_batch_size":
        msg = raw_request(batch(9, seed=23), version="1")
    mutate(msg)
    fast_before, _ = front.counts()
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(msg)
    assert refused.value.code() == code and words in (refused.value.details() or "")
    assert front.counts()[0] == fast_before


def test_32_concurrent_callers_are_batched_and_counted_as_32_requests(
    server: RunningServer, front: NativePort, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub, repo: Path
) -> None:
    inputs = [batch(1 + k % 3, seed=100 + k) for k in range(96)]
    before = server.dataplane.stats(MODEL, "1")[0][2]
    fast_before, _ = front.counts()
    channels = [grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") for _ in range(8)]
    stubs = [grpc_service_pb2_grpc.GRPCInferenceServiceStub(c) for c in channels]

    def call(k: int) -> pb.ModelInferResponse:
        return stubs[k % 8].ModelInfer(raw_request(inputs[k], version="1", request_id=f"c32-{k}"))

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, range(len(inputs))))
    for channel in channels:
        channel.close()
    session = ort.InferenceSession(str(repo / MODEL / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    for k, answer in enumerate(answers):
        assert answer.id == f"c32-{k}"
        np.testing.assert_allclose(logits(answer), session.run(None, {"input": inputs[k]})[0], rtol=1e-5, atol=1e-5)
    after = server.dataplane.stats(MODEL, "1")[0][2]
    assert front.counts()[0] - fast_before == len(inputs)
    assert after.requests - before.requests == len(inputs)  # Triton's success count: callers, not lane batches
    assert after.rows - before.rows == sum(len(x) for x in inputs)
    assert after.batches - before.batches < len(inputs)  # some were batched together


def test_weights_route_each_lane_request(
    server: RunningServer, stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    x = batch(1, seed=31)
    admin = admin_pb2_grpc.TrafficAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    try:
        cases = (({"1": 100, "2": 0}, {"1"}), ({"1": 0, "2": 100}, {"2"}), ({"1": 50, "2": 50}, {"1", "2"}))
        for weights, served in cases:
            change = admin_pb2.SetTrafficWeightsRequest(model_name=MODEL, weights=weights)
            admin.SetTrafficWeights(change, metadata=ADMIN)
            assert {stub.ModelInfer(raw_request(x)).model_version for _ in range(60)} == served
    finally:
        server.dataplane.set_weights(MODEL, {"1": 0, "2": 100})  # the conftest default: newest serves


def test_a_passed_call_carries_the_callers_metadata_and_address_not_a_forged_one(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = admin_pb2_grpc.TrafficAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    with pytest.raises(grpc.RpcError) as refused:
        admin.SetTrafficWeights(admin_pb2.SetTrafficWeightsRequest(model_name=MODEL, weights={"2": 100}))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    forged = [*ADMIN, ("x-sluicegate-peer", "ipv4:6.6.6.6:1")]
    with caplog.at_level(logging.INFO, logger="serving.grpc_api.servicer"):
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL), metadata=forged)
    lines = [r.getMessage() for r in caplog.records if "RepositoryModelLoad" in r.getMessage()]
    assert lines and all("by ipv4:127.0.0.1:" in line for line in lines), lines
    assert not any("6.6.6.6" in line for line in lines)


def test_a_passed_call_keeps_its_deadline(server: RunningServer) -> None:
    stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    x = batch(8, seed=41)
    typed = pb.ModelInferRequest(model_name="slow")
    tensor = typed.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    seen: list[grpc.StatusCode] = []

    def call() -> None:
        try:
            stub.ModelInfer(typed, timeout=0.002)
        except grpc.RpcError as exc:
            seen.append(exc.code())

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4


def test_health_watch_streams_through(server: RunningServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    first = next(stream)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    stream.cancel()
    channel.close()


def test_records_of_lane_requests_carry_the_inputs_digest(tmp_path: Path, repo: Path) -> None:
    log_file = tmp_path / "requests.jsonl"
    settings = ServingSettings(
        repository=str(repo), grpc_port=0, http_port=0, cache_dir=tmp_path / "cache", probe_interval_s=0,
        request_log_file=log_file,
    )  # fmt: skip
    running = start(settings)
    try:
        assert running.wait_ready(120)
        assert isinstance(running.grpc_server, NativePort)
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}"))
        inputs = {f"rec-{k}": batch(1, seed=300 + k) for k in range(24)}
        with ThreadPoolExecutor(12) as pool:
            for request_id, x in inputs.items():
                pool.submit(stub.ModelInfer, raw_request(x, version="1", request_id=request_id))
        assert running.grpc_server.counts()[0] >= len(inputs)
        assert running.flush_telemetry(30)
    finally:
        running.stop(grace=5, delay=0)
    records = {r["request_id"]: r for r in map(json.loads, log_file.read_text().splitlines())}
    for request_id, x in inputs.items():
        record = records[request_id]
        assert record["input_digest"] == raw_digest([x.tobytes()])
        assert (record["model_version"], record["status"], record["batch_size"]) == ("1", "OK", 1)
        assert record["runtime"] == "onnxruntime" and record["output_confidence"] is not None


def test_a_slow_version_does_not_hold_up_the_other_versions_requests_in_their_shared_lane(tmp_path: Path) -> None:
    from tests.fixtures.models import resnet, write_model_version

    root = tmp_path / "repo"
    quick = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(root, MODEL, "1", resnet(1), batching=quick)
    # Version 2 waits 1 s for company before every batch (the fault of benchmarks/rollout_time.py, longer);
    # its cap of 64 rows is never reached here, so every batch of it waits the whole second.
    slow = {"max_batch_size": 64, "max_queue_delay_us": 1_000_000, "max_queue_size": 256}
    write_model_version(root, MODEL, "2", resnet(2), batching=slow)
    settings = ServingSettings(
        repository=str(root), grpc_port=0, http_port=0, cache_dir=tmp_path / "cache", probe_interval_s=0
    )
    running = start(settings)
    try:
        assert running.wait_ready(120)
        running.dataplane.set_weights(MODEL, {"1": 50, "2": 50})
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}"))
        stub.ModelInfer(raw_request(batch(1, seed=499), version="1"))  # the channel connected before the start
        finished: list[tuple[float, str]] = []
        lock = threading.Lock()
        together = threading.Barrier(16)

        def call(k: int) -> None:
            x = raw_request(batch(1, seed=500 + k))  # no version: the shared lane
            together.wait()
            answer = stub.ModelInfer(x)
            with lock:
                finished.append((time.monotonic(), answer.model_version))

        fast_before = running.grpc_server.counts()[0]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(call, range(16)))
        assert running.grpc_server.counts()[0] - fast_before == 16
    finally:
        running.stop(grace=5, delay=0)
    versions = [version for _, version in sorted(finished)]
    assert set(versions) == {"1", "2"}, versions
    # Every answer from version 1 came before the first of the slow version 2's: none of them waited on it.
    assert versions.index("2") == versions.count("1"), versions


def test_a_version_whose_batches_fail_answers_every_caller_and_lets_the_server_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.fixtures.models import Doubled, resnet, write_model_version

    # caplog keeps every logged record, traceback and all, as pytest does for any failing test: a batch
    # must not depend on being garbage-collected to answer its callers (CI hung 600 s in Shutdown).
    caplog.set_level(logging.ERROR)
    root = tmp_path / "repo"
    write_model_version(root, MODEL, "1", Doubled(resnet(1)), batching={"max_batch_size": 8, "max_queue_delay_us": 0})
    settings = ServingSettings(
        repository=str(root), grpc_port=0, http_port=0, cache_dir=tmp_path / "cache", probe_interval_s=0
    )
    running = start(settings)
    stopped = threading.Event()
    try:
        assert running.wait_ready(120)
        assert isinstance(running.grpc_server, NativePort)
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}"))

        def call(k: int) -> grpc.StatusCode:
            try:
                stub.ModelInfer(raw_request(batch(1, seed=600 + k)), timeout=60)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        fast_before = running.grpc_server.counts()[0]
        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(call, range(16)))
        assert running.grpc_server.counts()[0] - fast_before == 16, "the calls did not take the lane"
        assert grpc.StatusCode.OK not in codes and grpc.StatusCode.DEADLINE_EXCEEDED not in codes, codes
        assert set(codes) == {grpc.StatusCode.INTERNAL}, codes  # the batcher refuses the doubled rows
    finally:
        stopper = threading.Thread(target=lambda: (running.stop(grace=5, delay=0), stopped.set()), daemon=True)
        stopper.start()
        stopper.join(60)
    assert stopped.is_set(), "the server did not stop: a failed batch left a call unfinished"
