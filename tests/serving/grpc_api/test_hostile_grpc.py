"""Hostile gRPC callers against the server as its own process (issue 18): each probe was observed to hurt
the server before (unauthenticated unloads, unbounded metric series and log lines, a weight that broke
routing, a BYTES flood decoded before its datatype was checked, late answers counted as OK). After each,
the server must be alive, ready and back within 20 % of its start-up RSS (``assert_recovered``)."""

from __future__ import annotations

import json
import secrets
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from serving.proto import admin_pb2, admin_pb2_grpc
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from tests.fixtures.models import resnet, write_model_version
from tests.serving.conftest import MODEL, batch
from tests.serving.process import TOKEN, ServerProcess

BEARER = (("authorization", f"Bearer {TOKEN}"),)
WRONG = (("authorization", "Bearer not-the-token"),)


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(repo, tmp_path_factory.mktemp("hostile"), env={"ADMIN_TOKEN": TOKEN})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model, for the servers started only to check a setting: they start faster."""
    root = tmp_path_factory.mktemp("small-repo")
    write_model_version(root, MODEL, "1", resnet(1), batching={"max_batch_size": 8, "max_queue_delay_us": 0})
    return root


def stub(server: ServerProcess) -> pb_grpc.GRPCInferenceServiceStub:
    channel = grpc.insecure_channel(
        f"127.0.0.1:{server.grpc_port}", options=[("grpc.max_send_message_length", 200 * 2**20)]
    )
    return pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def code_of(call: object, *args: object, **kwargs: object) -> grpc.StatusCode:
    try:
        call(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return,attr-defined]
    return grpc.StatusCode.OK


def details_of(call: object, *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    try:
        call(*args, **kwargs)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def scrape(server: ServerProcess) -> str:
    response = server.http("GET", "/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def infer_request(model: str = MODEL, version: str = "", rows: int = 1, seed: int = 0) -> pb.ModelInferRequest:
    x = batch(rows, seed)
    msg = pb.ModelInferRequest(model_name=model, model_version=version)
    msg.inputs.add(name="input", datatype="FP32", shape=x.shape)
    msg.raw_input_contents.append(x.tobytes())
    return msg


def wait_for_log(server: ServerProcess, text: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = server.log_text()
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the server log:\n{server.log_text()[-3000:]}")


# --- 1. repository load / unload need the admin token --------------------------------------------------


def test_load_and_unload_need_the_token_and_are_logged(server: ServerProcess) -> None:
    api = stub(server)
    unload = pb.RepositoryModelUnloadRequest(model_name=MODEL)
    load = pb.RepositoryModelLoadRequest(model_name=MODEL)
    refused = "sluicegate_auth_refused_total"
    before = scrape(server)

    assert code_of(api.RepositoryModelUnload, unload) == grpc.StatusCode.UNAUTHENTICATED
    assert api.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready  # the champion still serves
    assert code_of(api.RepositoryModelUnload, unload, metadata=WRONG) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(api.RepositoryModelLoad, load) == grpc.StatusCode.UNAUTHENTICATED
    assert api.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
    after = scrape(server)
    for action, reason in [
        ("RepositoryModelUnload", "missing"),
        ("RepositoryModelUnload", "wrong"),
        ("RepositoryModelLoad", "missing"),
    ]:
        labels = {"action": action, "reason": reason}
        assert sample(after, refused, **labels) - sample(before, refused, **labels) == 1, labels
    log = wait_for_log(server, "refused RepositoryModelUnload from ipv4:127.0.0.1")
    assert "refused RepositoryModelLoad from ipv4:127.0.0.1" in log

    # Reads stay open by default.
    index = api.RepositoryIndex(pb.RepositoryIndexRequest())
    assert {(m.name, m.state) for m in index.models} >= {(MODEL, "READY")}

    # With the token: "engine" (nothing else in this module uses it) goes and comes back, logged with the peer.
    api.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="engine"), metadata=BEARER)
    assert not api.ModelReady(pb.ModelReadyRequest(name="engine")).ready
    wait_for_log(server, "RepositoryModelUnload of 'engine' by ipv4:127.0.0.1")
    api.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="engine"), metadata=BEARER)
    assert api.ModelReady(pb.ModelReadyRequest(name="engine")).ready
    wait_for_log(server, "RepositoryModelLoad of 'engine' by ipv4:127.0.0.1")
    server.assert_recovered("unauthenticated repository calls")


def test_tritonclient_unload_and_load_with_the_token_header(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(InferenceServerException) as refused:
        client.unload_model("engine")
    assert "UNAUTHENTICATED" in str(refused.value.status())
    assert client.is_model_ready("engine")
    headers = {"authorization": f"Bearer {TOKEN}"}
    client.unload_model("engine", headers=headers)
    assert not client.is_model_ready("engine")
    client.load_model("engine", headers=headers)
    assert client.is_model_ready("engine")
    server.assert_recovered("tritonclient repository calls")


def test_without_a_token_changes_are_denied_unless_admin_open(small_repo: Path, tmp_path: Path) -> None:
    for name in ("closed", "open"):
        (tmp_path / name).mkdir()
    closed = ServerProcess(small_repo, tmp_path / "closed", env={"READ_REQUIRES_TOKEN": "true"})
    try:
        api = stub(closed)
        for metadata in ((), BEARER):  # no token configured: no token can be right
            unload = pb.RepositoryModelUnloadRequest(model_name=MODEL)
            assert code_of(api.RepositoryModelUnload, unload, metadata=metadata) == grpc.StatusCode.PERMISSION_DENIED
            load = pb.RepositoryModelLoadRequest(model_name=MODEL)
            assert code_of(api.RepositoryModelLoad, load, metadata=metadata) == grpc.StatusCode.PERMISSION_DENIED
        # Reads need the token here, and there is none.
        index = pb.RepositoryIndexRequest()
        assert code_of(api.RepositoryIndex, index) == grpc.StatusCode.PERMISSION_DENIED
        assert api.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
        closed.assert_recovered("changing calls without a configured token")
    finally:
        closed.stop()
    opened = ServerProcess(small_repo, tmp_path / "open", env={"ADMIN_OPEN": "true"})
    try:
        api = stub(opened)
        api.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=MODEL))
        assert not api.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
        api.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=MODEL))
        assert api.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
        wait_for_log(opened, f"RepositoryModelUnload of '{MODEL}' by ipv4:127.0.0.1")
        opened.assert_recovered("open repository calls")
    finally:
        opened.stop()


def test_reads_need_the_token_when_configured(small_repo: Path, tmp_path: Path) -> None:
    process = ServerProcess(small_repo, tmp_path, env={"ADMIN_TOKEN": TOKEN, "READ_REQUIRES_TOKEN": "true"})
    try:
        api = stub(process)
        index = pb.RepositoryIndexRequest()
        assert code_of(api.RepositoryIndex, index) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(api.RepositoryIndex, index, metadata=WRONG) == grpc.StatusCode.UNAUTHENTICATED
        assert {m.name for m in api.RepositoryIndex(index, metadata=BEARER).models} == {MODEL}
        process.assert_recovered("repository index without the token")
    finally:
        process.stop()


# --- 2. request text never becomes metric labels or long log lines -------------------------------------


def test_unknown_model_names_do_not_grow_the_metrics(server: ServerProcess) -> None:
    api = stub(server)
    assert code_of(api.ModelInfer, infer_request(model="warm-up-unknown")) == grpc.StatusCode.NOT_FOUND
    before = scrape(server)
    unknown = "sluicegate_inference_requests_total"
    counted = sample(before, unknown, model="_unknown", version="", code="NOT_FOUND")
    for _ in range(2000):
        name = secrets.token_hex(8)
        assert code_of(api.ModelInfer, infer_request(model=name, version=secrets.token_hex(2))) == (
            grpc.StatusCode.NOT_FOUND
        )
    after = scrape(server)
    assert series(after) == series(before), (series(before), series(after))  # was 56 -> 4,056
    assert sample(after, unknown, model="_unknown", version="", code="NOT_FOUND") == counted + 2000
    server.assert_recovered("2,000 unknown model names")


def test_megabyte_model_names_are_cut_in_errors_metrics_and_logs(server: ServerProcess) -> None:
    api = stub(server)
    metrics_before = len(scrape(server))
    log_before = server.log.stat().st_size
    huge = "m" * (4 * 2**20)
    for _ in range(5):
        code, details = details_of(api.ModelInfer, infer_request(model=huge, version=huge[: 2**20]), timeout=60)
        assert code == grpc.StatusCode.NOT_FOUND
        assert len(details) < 2000, len(details)
    code, details = details_of(
        api.ModelInfer, pb.ModelInferRequest(model_name=MODEL, id=huge, inputs=[{"name": huge, "datatype": "FP32"}])
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 2000
    wait_for_log(server, '"status":"INVALID_ARGUMENT"')
    time.sleep(0.5)  # the request-log lines are written by the telemetry thread
    grown = server.log.stat().st_size - log_before
    assert grown < 64 * 1024, grown  # was 21.9 MB for five requests
    assert len(scrape(server)) - metrics_before < 4096  # was 42.5 MB
    for line in server.log_text().splitlines()[-20:]:
        assert len(line) < 4096
    server.assert_recovered("4 MiB model names")


# --- 3. traffic weights are bounded on every path --------------------------------------------------------


def test_huge_traffic_weights_are_refused_and_routing_keeps_working(server: ServerProcess) -> None:
    admin = admin_pb2_grpc.TrafficAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))  # type: ignore[no-untyped-call]
    api = stub(server)
    get = admin_pb2.GetTrafficWeightsRequest(model_name=MODEL)
    weights_before = dict(admin.GetTrafficWeights(get, metadata=BEARER).weights)
    for weights in ({"1": 2**32 - 1}, {"1": 1_000_001, "2": 0}):  # uint32 allows far more than MAX_WEIGHT
        request = admin_pb2.SetTrafficWeightsRequest(model_name=MODEL, weights=weights)
        code, details = details_of(admin.SetTrafficWeights, request, metadata=BEARER)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "up to 1000000" in details, details
    # Over HTTP too: 10**400 was accepted, then every unversioned request failed INTERNAL (OverflowError).
    body = '{"weights": {"1": 1' + "0" * 400 + "}}"
    response = server.http(
        "PUT",
        f"/v2/models/{MODEL}/traffic",
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert dict(admin.GetTrafficWeights(get, metadata=BEARER).weights) == weights_before
    answer = api.ModelInfer(infer_request())  # unversioned: routed by the weights
    assert answer.model_name == MODEL and answer.raw_output_contents
    assert json.loads(server.http("GET", "/v2/health/ready", timeout=10).text)["ready"]
    server.assert_recovered("huge traffic weights")


# --- 4. tensors are checked against the model before decoding -------------------------------------------


def test_a_bytes_flood_to_an_fp32_input_is_refused_before_decoding(server: ServerProcess) -> None:
    api = stub(server)
    count = 8_000_000
    flood = pb.ModelInferRequest(model_name=MODEL, model_version="1")
    flood.inputs.add(name="input", datatype="BYTES", shape=[count])
    flood.raw_input_contents.append((struct.pack("<I", 1) + b"a") * count)  # 40 MB
    code, details = details_of(api.ModelInfer, flood, timeout=120)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "datatype BYTES, expected FP32" in details
    # The same flood under a name the model does not take, and as a count its buffer cannot hold.
    flood.inputs[0].name = "extra"
    code, details = details_of(api.ModelInfer, flood, timeout=120)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unexpected ['extra']" in details, details
    short = pb.ModelInferRequest(model_name="nowhere")
    short.inputs.add(name="input", datatype="BYTES", shape=[count])
    short.raw_input_contents.append((struct.pack("<I", 1) + b"a") * 1000)
    assert code_of(api.ModelInfer, short, timeout=60) == grpc.StatusCode.NOT_FOUND
    del flood
    server.assert_recovered("8 M one-byte BYTES elements to an FP32 input")


def test_typed_contents_of_the_wrong_datatype_are_refused_before_decoding(server: ServerProcess) -> None:
    api = stub(server)
    msg = pb.ModelInferRequest(model_name=MODEL, model_version="1")
    tensor = msg.inputs.add(name="input", datatype="INT64", shape=[1, 3, 32, 32])
    tensor.contents.int64_contents.extend(np.zeros(3 * 32 * 32, np.int64).tolist())
    code, details = details_of(api.ModelInfer, msg)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "datatype INT64, expected FP32" in details
    # The general path still answers what it should (typed FP32 contents).
    good = pb.ModelInferRequest(model_name=MODEL, model_version="1")
    typed = good.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
    typed.contents.fp32_contents.extend(batch(1, 3).ravel().tolist())
    answer = api.ModelInfer(good)
    assert answer.model_version == "1" and answer.outputs[0].contents.fp32_contents
    server.assert_recovered("typed contents of the wrong datatype")


# --- 5. answers after the deadline are counted as what the client saw -----------------------------------


def test_requests_past_their_deadline_are_counted_as_deadline_exceeded(server: ServerProcess) -> None:
    api = stub(server)
    total = "sluicegate_inference_requests_total"
    before = scrape(server)
    late = 0
    for seed in range(3):
        code = code_of(api.ModelInfer, infer_request(model="slow", version="1", rows=8, seed=seed), timeout=0.02)
        late += code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late == 3
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the handlers finish after the clients gave up
        after = scrape(server)
        counted = sample(after, total, model="slow", version="1", code="DEADLINE_EXCEEDED")
        if counted - sample(before, total, model="slow", version="1", code="DEADLINE_EXCEEDED") >= 1:
            break
        time.sleep(0.2)
    time.sleep(1)
    after = scrape(server)
    slow = {"model": "slow", "version": "1"}
    grew = {
        code: sample(after, total, **slow, code=code) - sample(before, total, **slow, code=code)
        for code in ("OK", "DEADLINE_EXCEEDED", "CANCELLED")
    }
    assert grew["OK"] == 0, grew
    assert grew["DEADLINE_EXCEEDED"] >= 1, grew
    # A request with time to spare is still OK.
    api.ModelInfer(infer_request(model="slow", version="1"), timeout=60)
    assert (
        sample(scrape(server), total, model="slow", version="1", code="OK")
        == sample(after, total, model="slow", version="1", code="OK") + 1
    )
    server.assert_recovered("requests past their deadline")
