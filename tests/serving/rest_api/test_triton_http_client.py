"""Triton's own HTTP client (``tritonclient.http``) against the side port, unchanged: health, metadata,
inference with JSON and with binary tensor data both ways, and the repository extension (index, load,
unload with the admin token), over plain HTTP and over mutual TLS."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures.models import resnet, write_model_version
from tests.fixtures.tls import Pki, make_pki
from tests.serving.conftest import MODEL, SHAPE, batch

TOKEN = "s3cret"  # tests/serving/conftest.py's admin token
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    triton = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield triton
    triton.close()


def _infer(
    triton: httpclient.InferenceServerClient, images: np.ndarray, *, binary: bool, version: str = "1"
) -> np.ndarray:
    tensor = httpclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
    result = triton.infer(MODEL, [tensor], model_version=version, outputs=wanted)
    logits = result.as_numpy("logits")
    assert isinstance(logits, np.ndarray)
    return logits


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "2")
    assert not client.is_model_ready("nosuchmodel")
    assert client.get_server_metadata()["name"] == "sluicegate"
    meta = client.get_model_metadata(MODEL, "1")
    assert meta["name"] == MODEL and set(meta["versions"]) >= {"1", "2"}
    assert meta["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, *SHAPE]}
    with pytest.raises(InferenceServerException, match="nosuchmodel"):
        client.get_model_metadata("nosuchmodel")


def test_inference_json_and_binary_agree(client: httpclient.InferenceServerClient) -> None:
    images = batch(3, seed=7)
    as_json = _infer(client, images, binary=False)
    as_binary = _infer(client, images, binary=True)
    assert as_json.shape == (3, as_json.shape[1]) and as_json.dtype == np.float32
    np.testing.assert_allclose(as_json, as_binary, rtol=1e-6, atol=1e-6)
    # Binary input, JSON output and the other way round.
    tensor = httpclient.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=True)
    result = client.infer(MODEL, [tensor], model_version="1", outputs=[httpclient.InferRequestedOutput("logits")])
    np.testing.assert_allclose(result.as_numpy("logits"), as_json, rtol=1e-6, atol=1e-6)
    with pytest.raises(InferenceServerException, match="expected"):
        bad = httpclient.InferInput("input", [1, 3, 8, 8], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32), binary_data=True)
        client.infer(MODEL, [bad], model_version="1")


def test_repository_index_load_and_unload(client: httpclient.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert {(e["name"], e["version"], e["state"]) for e in index} >= {(MODEL, "1", "READY"), ("engine", "1", "READY")}
    with pytest.raises(InferenceServerException, match="token"):
        client.unload_model("engine")
    try:
        client.unload_model("engine", headers=AUTH)
        assert not client.is_model_ready("engine")
        states = {(e["name"], e["version"]): e["state"] for e in client.get_model_repository_index()}
        assert states[("engine", "1")] == "UNAVAILABLE"
    finally:
        client.load_model("engine", headers=AUTH)  # the server's readiness needs every model back
    assert client.is_model_ready("engine") and client.is_server_ready()
    with pytest.raises(InferenceServerException, match="nosuchmodel"):
        client.load_model("nosuchmodel", headers=AUTH)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("tls-repo")
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(root, MODEL, "1", resnet(1), batching=batching)
    settings = ServingSettings(
        repository=str(root),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path_factory.mktemp("tls-cache"),
        admin_token=TOKEN,
        probe_interval_s=0,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_client_ca_file=pki.ca,
    )
    running = start(settings)
    assert running.wait_ready(120), running.dataplane.index()
    yield running
    running.stop(grace=5)


def _tls_client(server: RunningServer, options: dict[str, str]) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", ssl=True, ssl_options=options)


def test_over_mutual_tls(tls_server: RunningServer, pki: Pki) -> None:
    options = {"ca_certs": str(pki.ca), "certfile": str(pki.client.cert), "keyfile": str(pki.client.key)}
    triton = _tls_client(tls_server, options)
    try:
        assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready(MODEL)
        assert triton.get_model_metadata(MODEL)["name"] == MODEL
        images = batch(2, seed=3)
        np.testing.assert_allclose(
            _infer(triton, images, binary=True), _infer(triton, images, binary=False), rtol=1e-6, atol=1e-6
        )
        assert [e["name"] for e in triton.get_model_repository_index()] == [MODEL]
        triton.load_model(MODEL, headers=AUTH)  # already loaded: a no-op that still needs the token
    finally:
        triton.close()
    # Without a client certificate the handshake is refused.
    anonymous = _tls_client(tls_server, {"ca_certs": str(pki.ca)})
    try:
        with pytest.raises(Exception):  # noqa: B017  (gevent raises ssl/socket errors of several kinds)
            anonymous.is_server_live()
    finally:
        anonymous.close()
