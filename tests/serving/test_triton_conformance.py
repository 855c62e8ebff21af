"""Triton's own clients against the server, with TLS off, TLS on, and mutual TLS: every call a Triton
client makes of a V2 server (health, metadata, config, statistics, repository index, load/unload with the
admin token, inference with raw and JSON tensors and requested outputs), over gRPC (``tritonclient.grpc``
plus ``grpc.health.v1``) and HTTP (``tritonclient.http``). The clients are used unchanged: what works
here works for anyone with Triton's tooling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures.tls import Pki, make_pki, server_tls
from tests.serving.conftest import MODEL, batch

TOKEN = "conformance-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MODES = ("plain", "tls", "mtls")


@dataclass
class Served:
    mode: str
    server: RunningServer
    pki: Pki

    def grpc_client(self) -> grpcclient.InferenceServerClient:
        url = f"127.0.0.1:{self.server.grpc_port}"
        if self.mode == "plain":
            return grpcclient.InferenceServerClient(url)
        cert = self.pki.client if self.mode == "mtls" else None
        return grpcclient.InferenceServerClient(
            url,
            ssl=True,
            root_certificates=str(self.pki.ca),
            private_key=str(cert.key) if cert else None,
            certificate_chain=str(cert.cert) if cert else None,
        )

    def http_client(self) -> httpclient.InferenceServerClient:
        url = f"127.0.0.1:{self.server.http_port}"
        if self.mode == "plain":
            return httpclient.InferenceServerClient(url)
        options: dict[str, Any] = {"ca_certs": str(self.pki.ca)}
        if self.mode == "mtls":
            options |= {"certfile": str(self.pki.client.cert), "keyfile": str(self.pki.client.key)}
        return httpclient.InferenceServerClient(url, ssl=True, ssl_options=options)

    def health_channel(self) -> grpc.Channel:
        target = f"127.0.0.1:{self.server.grpc_port}"
        if self.mode == "plain":
            return grpc.insecure_channel(target)
        pair = self.pki.client if self.mode == "mtls" else None
        credentials = grpc.ssl_channel_credentials(
            self.pki.ca.read_bytes(),
            pair.key.read_bytes() if pair else None,
            pair.cert.read_bytes() if pair else None,
        )
        return grpc.secure_channel(target, credentials)


@pytest.fixture(scope="module", params=MODES)
def served(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    mode: str = request.param
    pki = make_pki(tmp_path_factory.mktemp(f"pki-{mode}"))
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path_factory.mktemp(f"cache-{mode}"),
        admin_token=TOKEN,
        probe_interval_s=0,
        shutdown_delay_s=0,
        **server_tls(pki, mode),  # type: ignore[arg-type]
    )
    running = start(settings)
    assert running.wait_ready(120), running.dataplane.index()
    yield Served(mode, running, pki)
    running.stop(grace=5)


def _grpc_checks(served: Served) -> dict[str, Callable[[], object]]:
    c = served.grpc_client()
    x = batch(2, seed=7)

    def infer_raw() -> object:
        given = grpcclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        result = c.infer(MODEL, [given], outputs=[grpcclient.InferRequestedOutput("logits")])
        logits = result.as_numpy("logits")
        assert logits is not None and logits.shape[0] == 2
        return logits

    def infer_versioned() -> object:
        given = grpcclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        result = c.infer(MODEL, [given], model_version="1")
        assert result.get_response().model_version == "1"
        return result

    def health() -> object:
        stub = health_pb2_grpc.HealthStub(served.health_channel())
        for service in ("", "inference.GRPCInferenceService"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, (service, status)
        return True

    return {
        "is_server_live": lambda: _true(c.is_server_live()),
        "is_server_ready": lambda: _true(c.is_server_ready()),
        "is_model_ready": lambda: _true(c.is_model_ready(MODEL)),
        "get_server_metadata": lambda: _named(c.get_server_metadata(as_json=True)),
        "get_model_metadata": lambda: _named(c.get_model_metadata(MODEL, as_json=True), MODEL),
        "get_model_config": lambda: _named(c.get_model_config(MODEL, as_json=True)["config"], MODEL),
        "get_inference_statistics": lambda: _listed(c.get_inference_statistics(MODEL, as_json=True)),
        "get_model_repository_index": lambda: _indexed(c.get_model_repository_index(as_json=True)["models"]),
        "infer_raw_with_requested_output": infer_raw,
        "infer_named_version": infer_versioned,
        "grpc_health_v1": health,
        "unload_and_load_with_token": lambda: _unload_and_load(c),
    }


def _http_checks(served: Served) -> dict[str, Callable[[], object]]:
    c = served.http_client()
    x = batch(2, seed=8)

    def infer(binary: bool) -> object:
        given = httpclient.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x, binary_data=binary)
        wanted = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
        logits = c.infer(MODEL, [given], outputs=wanted).as_numpy("logits")
        assert logits is not None and logits.shape[0] == 2 and np.isfinite(logits).all()
        return logits

    return {
        "is_server_live": lambda: _true(c.is_server_live()),
        "is_server_ready": lambda: _true(c.is_server_ready()),
        "is_model_ready": lambda: _true(c.is_model_ready(MODEL)),
        "get_server_metadata": lambda: _named(c.get_server_metadata()),
        "get_model_metadata": lambda: _named(c.get_model_metadata(MODEL), MODEL),
        "get_model_config": lambda: _named(c.get_model_config(MODEL), MODEL),
        "get_inference_statistics": lambda: _listed(c.get_inference_statistics(MODEL)),
        "get_model_repository_index": lambda: _indexed(c.get_model_repository_index()),
        "infer_json": lambda: infer(False),
        "infer_binary_tensors": lambda: infer(True),
        "unload_and_load_with_token": lambda: _unload_and_load(c),
    }


def _unload_and_load(c: Any) -> object:
    """The same calls on either client: the admin token in ``headers``, the model back at the end."""
    c.unload_model("engine", headers=AUTH)
    assert not c.is_model_ready("engine")
    c.load_model("engine", headers=AUTH)
    assert c.is_model_ready("engine")
    return True


def _true(value: object) -> object:
    assert value is True, value
    return value


def _named(document: dict[str, Any], name: str | None = None) -> object:
    assert document.get("name"), document
    assert name is None or document["name"] == name, document
    return document


def _listed(document: dict[str, Any]) -> object:
    stats = document["model_stats"]
    assert stats and {s["name"] for s in stats} == {MODEL}, document
    return document


def _indexed(models: list[dict[str, Any]]) -> object:
    assert {m["name"] for m in models} >= {MODEL, "slow", "engine"}, models
    return models


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_triton_clients_pass_every_check(served: Served, transport: str) -> None:
    checks = _grpc_checks(served) if transport == "grpc" else _http_checks(served)
    failed = {}
    for name, check in checks.items():
        try:
            check()
        except Exception as exc:  # collect them all: the failure lists every call that broke
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert failed == {}, f"{transport} with {served.mode}: {len(failed)}/{len(checks)} failed: {failed}"
    assert served.server.dataplane.ready()


@pytest.mark.parametrize("served", ["mtls"], indirect=True)
def test_under_mutual_tls_a_client_without_a_certificate_is_refused(served: Served) -> None:
    no_cert = grpcclient.InferenceServerClient(
        f"127.0.0.1:{served.server.grpc_port}", ssl=True, root_certificates=str(served.pki.ca)
    )
    with pytest.raises(Exception, match=r"UNAVAILABLE|handshake|certificate|SSL"):
        no_cert.is_server_live()
    plain_http = httpclient.InferenceServerClient(
        f"127.0.0.1:{served.server.http_port}", ssl=True, ssl_options={"ca_certs": str(served.pki.ca)}
    )
    with pytest.raises(Exception):  # noqa: B017 - a TLS alert, surfaced by gevent as one of several types
        plain_http.is_server_live()
