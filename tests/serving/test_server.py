"""The server over real sockets with Triton's own Python client (tritonclient.grpc), raw gRPC stubs and
HTTP: protocol, input safety, concurrency, fallback, traffic weights, load/unload while serving."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc
from serving.server import RunningServer
from tests.serving.conftest import MODEL, batch

ADMIN = {"authorization": "Bearer s3cret"}  # the conftest server's admin token


def reference(repo: Path, model: str, version: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / model / version / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def client(server: RunningServer) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def infer(c: triton.InferenceServerClient, x: np.ndarray, model: str = MODEL, version: str = "") -> triton.InferResult:
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    return c.infer(model, [given], model_version=version)


def stub(server: RunningServer) -> grpc_service_pb2_grpc.GRPCInferenceServiceStub:
    return grpc_service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))


def test_live_ready_metadata_and_config_through_tritons_client(server: RunningServer) -> None:
    c = client(server)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(MODEL) and c.is_model_ready(MODEL, "2")
    assert not c.is_model_ready("absent")
    meta = c.get_model_metadata(MODEL, as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "3", "32", "32"]}]
    assert set(meta["versions"]) == {"1", "2"} and meta["platform"] == "onnxruntime_onnx"
    config = c.get_model_config(MODEL, as_json=True)["config"]
    assert int(config["max_batch_size"]) == 8 and config["input"][0]["dims"] == ["3", "32", "32"]
    assert c.get_server_metadata(as_json=True)["name"] == "sluicegate"
    index = {
        (e["name"], e.get("version", "")): e.get("state") for e in c.get_model_repository_index(as_json=True)["models"]
    }
    assert index[(MODEL, "1")] == "READY"
    stats = c.get_inference_statistics(MODEL, as_json=True)
    assert {s["version"] for s in stats["model_stats"]} == {"1", "2"}


def test_raw_and_typed_contents_answer_like_onnx_runtime(server: RunningServer, repo: Path) -> None:
    x = batch(3, seed=1)
    raw = infer(client(server), x, version="1")
    assert raw.get_response().model_version == "1"
    np.testing.assert_allclose(raw.as_numpy("logits"), reference(repo, MODEL, "1", x), rtol=1e-5, atol=1e-5)
    typed = pb.ModelInferRequest(model_name=MODEL, model_version="2", id="typed-1")
    tensor = typed.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    answer = stub(server).ModelInfer(typed)
    assert answer.id == "typed-1" and answer.model_version == "2" and not answer.raw_output_contents
    got = np.asarray(answer.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(answer.outputs[0].shape)
    np.testing.assert_allclose(got, reference(repo, MODEL, "2", x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("mutate", "code", "words"),
    [
        (lambda r: setattr(r, "model_name", "absent"), grpc.StatusCode.NOT_FOUND, "absent"),
        (lambda r: setattr(r, "model_version", "9"), grpc.StatusCode.NOT_FOUND, "'9'"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP64"), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (lambda r: r.inputs[0].shape.__setitem__(2, 31), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (
            lambda r: r.raw_input_contents.__setitem__(0, r.raw_input_contents[0][:-4]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input",
        ),
        (lambda r: setattr(r.inputs[0], "name", "image"), grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ],
)
def test_bad_input_is_refused_by_name_and_the_server_keeps_serving(
    server: RunningServer, mutate: object, code: grpc.StatusCode, words: str
) -> None:
    x = batch(2, seed=2)
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    mutate(request)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as caught:
        stub(server).ModelInfer(request)
    assert caught.value.code() == code and words in caught.value.details()
    assert infer(client(server), x).as_numpy("logits").shape == (2, 4)


def test_a_batch_over_the_limit_and_too_many_elements_are_refused(server: RunningServer) -> None:
    with pytest.raises(InferenceServerException, match=r"batch of 9, expected 1 to 8"):
        infer(client(server), batch(9, seed=3))
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 2**40])
    with pytest.raises(grpc.RpcError) as caught:
        stub(server).ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_many_concurrent_clients_each_get_their_own_answer(server: RunningServer, repo: Path) -> None:
    inputs = [batch(1 + i % 3, seed=100 + i) for i in range(256)]
    expected = [reference(repo, MODEL, "1", x) for x in inputs]
    before = {s.rows: s for s in [server.dataplane.stats(MODEL, "1")[0][2]]}
    c = client(server)
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda x: infer(c, x, version="1").as_numpy("logits"), inputs))
    for got, want in zip(answers, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    after = server.dataplane.stats(MODEL, "1")[0][2]
    (previous,) = before.values()
    assert after.requests - previous.requests == 256
    assert after.batches - previous.batches < 256  # requests were batched together


def test_a_model_that_cannot_load_falls_back_and_still_answers(server: RunningServer, repo: Path) -> None:
    assert server.dataplane.runtime_of("engine", "1")[0] == "onnxruntime"  # model.plan failed on this host
    x = batch(2, seed=4)
    np.testing.assert_allclose(
        infer(client(server), x, model="engine").as_numpy("logits"), reference(repo, "engine", "1", x), atol=1e-5
    )
    assert server.dataplane.runtime_of("broken", "1")[0] == "rules"
    answer = infer(client(server), x, model="broken").get_response(as_json=True)
    assert answer["parameters"]["abnormal"]["bool_param"] is True
    metrics = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").text
    levels = {
        (s.labels["model"], s.labels["runtime"]): s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "sluicegate_runtime_fallback_level"
        for s in family.samples
    }
    assert levels[("engine", "onnxruntime")] == 1 and levels[(MODEL, "onnxruntime")] == 0
    assert levels[("broken", "rules")] >= 1


def test_weights_split_traffic_and_a_named_version_is_honoured(server: RunningServer) -> None:
    base = f"http://127.0.0.1:{server.http_port}/v2/models/{MODEL}/traffic"
    assert httpx.put(base, json={"weights": {"1": 80, "2": 20}}).status_code == 401
    headers = {"Authorization": "Bearer s3cret"}
    assert httpx.put(base, json={"weights": {"1": 80, "2": 20}}, headers=headers).json()["weights"] == {
        "1": 80,
        "2": 20,
    }
    c = client(server)
    x = batch(1, seed=5)
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda _: infer(c, x).get_response().model_version, range(2000)))
    share = versions.count("1") / len(versions)
    assert abs(share - 0.8) < 4 * (0.8 * 0.2 / 2000) ** 0.5, share  # four standard deviations
    assert {infer(c, x, version="2").get_response().model_version for _ in range(20)} == {"2"}
    assert httpx.put(base, json={"weights": {"9": 1}}, headers=headers).status_code in (400, 404)
    httpx.put(base, json={"weights": {"2": 1}}, headers=headers)


def test_http_side_port(server: RunningServer, repo: Path) -> None:
    http = f"http://127.0.0.1:{server.http_port}"
    assert httpx.get(f"{http}/health/live").status_code == 200
    assert httpx.get(f"{http}/health/ready").status_code == 200
    x = batch(1, seed=6)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    answer = httpx.post(f"{http}/v2/models/{MODEL}/versions/1/infer", json=body).json()
    got = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(answer["outputs"][0]["shape"])
    np.testing.assert_allclose(got, reference(repo, MODEL, "1", x), atol=1e-5)
    bad = httpx.post(
        f"{http}/v2/models/{MODEL}/infer",
        json={"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [1.0]}]},
    )
    assert bad.status_code == 400 and "input" in bad.json()["error"]
    families = {f.name for f in text_string_to_metric_families(httpx.get(f"{http}/metrics").text)}
    assert {"sluicegate_inference_requests", "sluicegate_inference_request_duration_seconds"} <= families


def test_grpc_health_and_random_bytes_do_not_hurt(server: RunningServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    rng = np.random.default_rng(0)
    for size in (1, 7, 64, 4096):
        with pytest.raises(grpc.RpcError):
            raw(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    assert infer(client(server), batch(1, seed=7)).as_numpy("logits").shape == (1, 4)


def test_loading_and_unloading_versions_while_serving_loses_no_request(server: RunningServer, repo: Path) -> None:
    import shutil

    from tests.fixtures.models import resnet, write_model_version

    c = client(server)
    stop, failures, done = threading.Event(), [], [0]

    def traffic() -> None:
        x = batch(1, seed=8)
        while not stop.is_set():
            try:
                infer(c, x)
                done[0] += 1
            except Exception as exc:  # every failure is a lost request
                failures.append(exc)

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        write_model_version(
            repo, MODEL, "3", resnet(6), batching={"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
        )
        c.load_model(MODEL, headers=ADMIN)
        assert c.is_model_ready(MODEL, "3")
        shutil.move(str(repo / MODEL / "1"), str(repo / "parked-1"))
        c.load_model(MODEL, headers=ADMIN)  # v1 left the repository: unloaded after its queue drains
        assert not c.is_model_ready(MODEL, "1") and c.is_model_ready(MODEL, "2")
    finally:
        stop.set()
        for w in workers:
            w.join()
        shutil.move(str(repo / "parked-1"), str(repo / MODEL / "1"))
        c.load_model(MODEL, headers=ADMIN)
    assert not failures, failures[:3]
    assert done[0] > 20


def test_traffic_weights_over_the_grpc_admin_service_need_the_token(server: RunningServer) -> None:
    from serving.proto import admin_pb2, admin_pb2_grpc

    admin = admin_pb2_grpc.TrafficAdminStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    request = admin_pb2.SetTrafficWeightsRequest(model_name=MODEL, weights={"1": 0, "2": 100})
    with pytest.raises(grpc.RpcError) as caught:
        admin.SetTrafficWeights(request, metadata=[("authorization", "Bearer wrong")])
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    token = [("authorization", "Bearer s3cret")]

    def positive(weights: object) -> dict[str, int]:  # versions loaded by earlier tests get weight 0
        return {k: v for k, v in dict(weights).items() if v}  # type: ignore[call-overload]

    assert positive(admin.SetTrafficWeights(request, metadata=token).weights) == {"2": 100}
    got = admin.GetTrafficWeights(admin_pb2.GetTrafficWeightsRequest(model_name=MODEL), metadata=token)
    assert positive(got.weights) == {"2": 100}
    c = client(server)
    assert {infer(c, batch(1, seed=9)).get_response().model_version for _ in range(30)} == {"2"}
    with pytest.raises(grpc.RpcError) as unknown:
        admin.SetTrafficWeights(admin_pb2.SetTrafficWeightsRequest(model_name=MODEL, weights={"7": 1}), metadata=token)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "'7'" in unknown.value.details()
