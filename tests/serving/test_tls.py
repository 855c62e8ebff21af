"""TLS on the gRPC port: with a certificate set the server binds only a TLS port (no plaintext one);
with a client CA set it requires a client certificate that CA signed. (Triton's clients doing their
calls with TLS off, on and mutual: tests/serving/test_triton_conformance.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures import tls as tls_fixture
from tests.fixtures.models import resnet, write_model_version
from tests.fixtures.tls import Pair, make_pki, server_tls

MODEL = "pcb"
BATCHING = {"max_batch_size": 4, "max_queue_delay_us": 0, "max_queue_size": 64}


@dataclass(frozen=True)
class Served:
    server: RunningServer
    mode: str  # "plain", "tls" or "mtls"
    pki: tls_fixture.Pki

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def client(self, pair: Pair | None = None, *, ssl: bool | None = None) -> triton.InferenceServerClient:
        """Triton's client: TLS trusting the test CA unless the server is plain, presenting ``pair``."""
        use_ssl = self.mode != "plain" if ssl is None else ssl
        if not use_ssl:
            return triton.InferenceServerClient(self.target)
        return triton.InferenceServerClient(
            self.target,
            ssl=True,
            root_certificates=str(self.pki.ca),
            private_key=str(pair.key) if pair else None,
            certificate_chain=str(pair.cert) if pair else None,
        )

    def good_client(self) -> triton.InferenceServerClient:
        return self.client(self.pki.client if self.mode == "mtls" else None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tls_fixture.Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tls-repo")
    write_model_version(root, MODEL, "1", resnet(1), batching=BATCHING)
    return root


def serve(repo: Path, cache: Path, pki: tls_fixture.Pki, mode: str) -> RunningServer:
    tls = server_tls(pki, mode)
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=cache,
        probe_interval_s=0,
        telemetry=False,
        shutdown_delay_s=0,
        **tls,  # type: ignore[arg-type]
    )
    return start(settings)


@pytest.fixture(scope="module", params=["plain", "tls", "mtls"])
def served(
    request: pytest.FixtureRequest, repo: Path, pki: tls_fixture.Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    running = serve(repo, tmp_path_factory.mktemp("cache"), pki, request.param)
    try:
        assert running.wait_ready(120), running.dataplane.index()
        yield Served(running, request.param, pki)
    finally:
        running.stop(grace=5, delay=0)


def refused(client: triton.InferenceServerClient) -> bool:
    try:
        client.is_server_live(client_timeout=10)
    except InferenceServerException:
        return True
    finally:
        client.close()
    return False


@pytest.mark.parametrize("served", ["tls", "mtls"], indirect=True)
def test_a_plaintext_client_is_refused_by_a_tls_server(served: Served) -> None:
    assert refused(served.client(ssl=False))


@pytest.mark.parametrize("served", ["plain"], indirect=True)
def test_a_tls_client_is_refused_by_a_plaintext_server(served: Served) -> None:
    assert refused(served.client(ssl=True))


@pytest.mark.parametrize("served", ["mtls"], indirect=True)
def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(served: Served) -> None:
    assert refused(served.client(None))  # TLS, trusts the server, but presents no certificate
    assert refused(served.client(served.pki.stranger))  # a certificate from another CA
    assert not refused(served.client(served.pki.client))


@pytest.mark.parametrize("served", ["tls", "mtls"], indirect=True)
def test_a_client_that_does_not_trust_the_server_ca_is_refused(served: Served, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other")
    client = triton.InferenceServerClient(
        served.target,
        ssl=True,
        root_certificates=str(other.ca),
        private_key=str(served.pki.client.key),
        certificate_chain=str(served.pki.client.cert),
    )
    assert refused(client)
