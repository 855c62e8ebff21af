"""The side port against hostile HTTP (issue 18's probe table, HTTP rows): each probe is sent to a real
``python -m serving`` process, which must answer as the table says, log no traceback, and stay alive,
ready and within 20 % of its start-up RSS (``ServerProcess.assert_recovered``). Raw-socket probes use
``socket`` directly, since an HTTP client would refuse to send them."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.traffic import MAX_ENTRIES
from tests.fixtures.tls import Pki, make_pki
from tests.serving.conftest import MODEL
from tests.serving.process import TOKEN, ServerProcess

TIMEOUT_S = 2.0  # header, body and keep-alive timeouts of the probed server
MIB = 2**20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = f"/v2/models/{MODEL}/versions/1/infer"


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {
        "ADMIN_TOKEN": TOKEN,
        "HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "HTTP_BODY_TIMEOUT_S": str(TIMEOUT_S),
        "HTTP_KEEPALIVE_S": str(TIMEOUT_S),
    }
    process = ServerProcess(repo, tmp_path_factory.mktemp("hostile"), env)
    yield process
    process.stop()


def connect(server: ServerProcess, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 answer with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed ``sock`` (reading and dropping whatever it sent first)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


class Answer:
    """The first answer read on a thread while the main thread keeps sending (the server may answer,
    then close, long before the body is through: reading only afterwards could lose it to a reset)."""

    def __init__(self, sock: socket.socket) -> None:
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(sock,), daemon=True)
        self._thread.start()

    def _read(self, sock: socket.socket) -> None:
        try:
            self.result = read_answer(sock)
        except BaseException as exc:
            self.error = exc

    def get(self, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        self._thread.join(timeout)
        assert self.result is not None, f"no answer: {self.error!r}"
        return self.result


def send_until_refused(sock: socket.socket, total: int, chunk: bytes) -> int:
    """Send up to ``total`` bytes of ``chunk`` repeats; the bytes sent before the server cut us off."""
    sent = 0
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    return sent


def metric(server: ServerProcess, family: str, **labels: str) -> float:
    text = server.http("GET", "/metrics").text
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == family and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def assert_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.log_text()


def infer_body(rows: int = 1) -> dict[str, Any]:
    data = np.zeros((rows, 3, 32, 32), dtype=np.float32)
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(data.shape), "data": data.ravel().tolist()}]}


# --- bodies ------------------------------------------------------------------------------------------


def test_deeply_nested_json_is_refused_naming_the_limit(server: ServerProcess) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    answer = server.http("POST", INFER, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 400
    assert "http_max_json_depth" in answer.json()["error"]
    deep_but_valid = {"inputs": [{"name": "x", "shape": [1], "data": json.loads("[" * 40 + "1" + "]" * 40)}]}
    answer = server.http("POST", INFER, json=deep_but_valid, timeout=30)
    assert answer.status_code == 400 and "http_max_json_depth" in answer.json()["error"]
    assert_no_traceback(server)
    server.assert_recovered("100,000 nested lists")


def test_malformed_content_length_is_a_400(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{{}}".encode())
        assert read_answer(sock)[0] == 400
    server.assert_recovered("Content-Length: abc")


def test_negative_content_length_is_refused_without_reading_the_body(server: ServerProcess) -> None:
    start = time.monotonic()
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n".encode())
        reader = Answer(sock)
        sent = send_until_refused(sock, 300 * MIB, b"1" * MIB)
        assert reader.get()[0] in (400, 413)
    assert sent < 300 * MIB, "the server kept reading a body it had refused"
    print(f"Content-Length -1: refused after {sent / MIB:.0f} MiB sent, {time.monotonic() - start:.2f} s")
    server.assert_recovered("Content-Length: -1 and 300 MiB")


def test_declared_body_over_the_limit_is_413_before_reading(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {300 * MIB}\r\n\r\n".encode())
        reader = Answer(sock)
        sent = send_until_refused(sock, 300 * MIB, b"1" * MIB)
        status, headers, body = reader.get()
    assert status == 413 and "limit" in json.loads(body)["error"] and headers.get("connection") == "close"
    assert sent < 300 * MIB
    server.assert_recovered("Content-Length: 300 MiB")


def test_a_refused_body_gets_a_lingering_close_not_a_reset(server: ServerProcess) -> None:
    """After a 413 the server half-closes and drains what the client still sends (bounded), so a client
    that reads its answer only after sending more gets the whole answer and an orderly end of stream; a
    plain close with the body unread made the kernel reset the connection (CI: a 413 without its body)."""
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {300 * MIB}\r\n\r\n".encode())
        sock.sendall(b"1" * MIB)
        time.sleep(1.0)  # the 413 is written and the server lingers (LINGER_S is 2 s)
        sock.sendall(b"1" * MIB)  # accepted and dropped: a closed socket would have reset us by now
        status, headers, body = read_answer(sock)
        assert status == 413 and "limit" in json.loads(body)["error"] and headers.get("connection") == "close"
        sock.settimeout(5)
        ended = time.monotonic()
        rest = b""
        while chunk := sock.recv(65536):  # ConnectionResetError here would be the old reset
            rest += chunk
        assert rest == b"", f"nothing may follow the answer: {rest[:80]!r}"
        assert time.monotonic() - ended < 5
    server.assert_recovered("a lingering close")


def test_chunked_body_over_the_limit_is_413_while_reading(server: ServerProcess) -> None:
    start, rss = time.monotonic(), server.rss()
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        reader = Answer(sock)
        piece = b"100000\r\n" + b" " * MIB + b"\r\n"  # 1 MiB chunks, JSON whitespace
        sent = send_until_refused(sock, 300 * MIB, piece)
        status, _, body = reader.get()
    assert status == 413 and str(100 * MIB) in json.loads(body)["error"]
    assert sent < 300 * MIB
    elapsed = time.monotonic() - start
    after = server.rss()
    print(f"chunked 300 MiB: 413 after {sent / MIB:.0f} MiB, {elapsed:.2f} s, RSS {rss / MIB:.0f}->{after / MIB:.0f}")
    server.assert_recovered("a chunked body past the limit")


def test_big_body_for_an_unknown_model_is_404_unparsed(server: ServerProcess) -> None:
    filler = b"0," * (95 * MIB // 2)
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[' + filler + b"0]}]}"
    before, start = server.rss(), time.monotonic()
    answer = server.http("POST", "/v2/models/nosuchmodel/infer", content=body, timeout=60)
    elapsed = time.monotonic() - start
    assert answer.status_code == 404 and "nosuchmodel" in answer.json()["error"]
    print(f"95 MiB for an unknown model: 404 in {elapsed:.2f} s, RSS {before / MIB:.0f}->{server.rss() / MIB:.0f} MiB")
    server.assert_recovered("a 95 MiB body for an unknown model")


# --- slow clients ------------------------------------------------------------------------------------


def test_a_stalled_body_is_closed_after_the_body_timeout(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n0123456789".encode())
        start = time.monotonic()
        status, headers, _ = read_answer(sock)
        waited = time.monotonic() - start + closed_within(sock, 4 * TIMEOUT_S)
    assert status == 408 and headers.get("connection") == "close"
    assert TIMEOUT_S * 0.9 <= waited <= 2 * TIMEOUT_S + 1
    server.assert_recovered("a stalled body")


def _family(server: ServerProcess) -> list[psutil.Process]:
    """The server and its worker processes (SLUICEGATE_SERVING__WORKERS > 1: the supervisor holds no
    connection, its workers accept them)."""
    return [server.ps, *server.ps.children(recursive=True)]


def _established(server: ServerProcess) -> int:
    return sum(
        1
        for process in _family(server)
        for c in process.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == server.http_port and c.status == "ESTABLISHED"
    )


def _threads(server: ServerProcess) -> int:
    return sum(process.num_threads() for process in _family(server))


def test_slow_headers_are_closed_after_the_header_timeout(server: ServerProcess) -> None:
    threads, open_before = _threads(server), _established(server)
    sockets = [connect(server) for _ in range(200)]
    try:
        for sock in sockets:
            sock.sendall(b"GET /health/li")  # half a request line, then nothing
        start = time.monotonic()
        # They are held (accepted) meanwhile. The loop accepts from the backlog at its own pace on a
        # busy machine, so wait for it, but not past the header timeout that will close them.
        held = _established(server)
        while held < open_before + 150 and time.monotonic() - start < TIMEOUT_S * 0.75:
            time.sleep(0.05)
            held = _established(server)
        assert held >= open_before + 150, f"only {held - open_before} of 200 slow connections accepted"
        for sock in sockets:
            closed_within(sock, 4 * TIMEOUT_S)
        waited = time.monotonic() - start
    finally:
        for sock in sockets:
            sock.close()
    assert waited <= 2 * TIMEOUT_S + 2, f"slow-header connections closed after {waited:.1f} s"
    deadline = time.monotonic() + 5
    while _established(server) > open_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _established(server) <= open_before
    assert _threads(server) <= threads + 2  # uvicorn holds connections on its loop, not on threads
    # One byte a second does not keep a connection either: the deadline runs from the first byte.
    with connect(server) as sock:
        start = time.monotonic()
        try:
            for byte in b"GET /health/live HTTP/1.1\r\n":
                sock.sendall(bytes([byte]))
                time.sleep(0.5)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - start + closed_within(sock, 4 * TIMEOUT_S) <= 2 * TIMEOUT_S + 2
    server.assert_recovered("200 slow-header connections")


# --- content types and chunked bodies ----------------------------------------------------------------


def test_chunked_request_body_is_served(server: ServerProcess) -> None:
    payload = json.dumps(infer_body(2)).encode()
    pieces = (payload[i : i + 4096] for i in range(0, len(payload), 4096))
    answer = server.http("POST", INFER, content=pieces, headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["shape"][0] == 2


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x"])
def test_a_json_route_refuses_other_content_types(server: ServerProcess, content_type: str) -> None:
    answer = server.http("POST", INFER, content=json.dumps(infer_body()), headers={"Content-Type": content_type})
    assert answer.status_code == 415
    assert "application/json" in answer.json()["error"] and "application/octet-stream" in answer.json()["error"]
    answer = server.http(
        "PUT",
        f"/v2/models/{MODEL}/traffic",
        content=b'{"weights": {"1": 1}}',
        headers={**AUTH, "Content-Type": content_type},
    )
    assert answer.status_code == 415 and "application/json" in answer.json()["error"]


# --- metrics and the element cap ---------------------------------------------------------------------


def test_rest_inference_is_counted_like_grpc(server: ServerProcess) -> None:
    ok = metric(server, "sluicegate_inference_requests_total", model=MODEL, version="1", code="OK")
    bad = metric(server, "sluicegate_inference_requests_total", model=MODEL, version="1", code="INVALID_ARGUMENT")
    assert server.http("POST", INFER, json=infer_body()).status_code == 200
    assert server.http("POST", INFER, json={"inputs": 5}).status_code == 400
    assert metric(server, "sluicegate_inference_requests_total", model=MODEL, version="1", code="OK") == ok + 1
    assert (
        metric(server, "sluicegate_inference_requests_total", model=MODEL, version="1", code="INVALID_ARGUMENT")
        == bad + 1
    )


def test_the_element_cap_holds_before_decoding(server: ServerProcess) -> None:
    huge = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2**40, 3], "data": [0]}]}
    answer = server.http("POST", INFER, json=huge)
    assert answer.status_code == 400 and "cap" in answer.json()["error"]
    # JSON data shorter than the shape says: refused by count, not after building arrays.
    short = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [4, 3, 32, 32], "data": [0.0] * 10}]}
    answer = server.http("POST", INFER, json=short)
    assert answer.status_code == 400 and "expected 12288" in answer.json()["error"]
    # Binary: binary_data_size against shape x dtype size, before any slice.
    image = {"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "parameters": {"binary_data_size": 8}}
    header = json.dumps({"inputs": [image]}).encode()
    answer = server.http(
        "POST",
        INFER,
        content=header + b"\0" * 8,
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    assert answer.status_code == 400 and "binary_data_size is 8 bytes; expected 12288" in answer.json()["error"]
    server.assert_recovered("tensors over the element cap")


# --- echoes ------------------------------------------------------------------------------------------


def test_long_request_fields_are_not_echoed_whole(server: ServerProcess) -> None:
    log_before = len(server.log_text())
    with connect(server) as sock:  # a 4 MiB model name: refused on the head, never routed
        sock.sendall(b"GET /v2/models/")
        reader = Answer(sock)
        send_until_refused(sock, 4 * MIB, b"m" * 65536)
        status, _, body = reader.get()
    assert status in (400, 414) and len(body) < 1000
    answer = server.http("GET", "/v2/models/" + "m" * 3000)
    assert answer.status_code == 414 and len(answer.content) < 1000
    answer = server.http("POST", f"/v2/models/{'m' * 1500}/infer", json=infer_body())
    assert answer.status_code == 404 and len(answer.content) < 1000
    name = "x" * (4 * MIB)
    answer = server.http("POST", INFER, json={"inputs": [{"name": name, "datatype": "FP32", "shape": [1]}]})
    assert answer.status_code == 400 and len(answer.content) < 1000
    wrongs = ({"inputs": [{"name": "i", "datatype": name, "shape": [1]}]}, {"inputs": name}, {"id": name, "inputs": []})
    for wrong in wrongs:
        answer = server.http("POST", INFER, json=wrong)
        assert answer.status_code == 400 and len(answer.content) < 1000, answer.text[:300]
    longest = max(len(line) for line in server.log_text()[log_before:].splitlines() or [""])
    assert longest < 2000
    server.assert_recovered("4 MiB request fields")


# --- admin: weights and authorisation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    ["10**400", "1.5", "true", "2000000", "-1", '"5"', "null"],
)
def test_weights_must_be_bounded_integers(server: ServerProcess, weights: str) -> None:
    body = '{"weights": {"1": ' + (str(10**400) if weights == "10**400" else weights) + ', "2": 1}}'
    answer = server.http(
        "PUT", f"/v2/models/{MODEL}/traffic", content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert answer.status_code == 400, answer.text
    assert len(answer.content) < 1000


def test_too_many_weight_entries_are_refused(server: ServerProcess) -> None:
    weights = {str(v): 1 for v in range(5000)}
    answer = server.http("PUT", f"/v2/models/{MODEL}/traffic", json={"weights": weights}, headers=AUTH)
    assert answer.status_code == 400 and f"at most {MAX_ENTRIES}" in answer.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "action"),
    [
        ("PUT", f"/v2/models/{MODEL}/traffic", "SetTrafficWeights"),
        ("POST", f"/v2/models/{MODEL}/traffic", "SetTrafficWeights"),
        ("POST", f"/v2/repository/models/{MODEL}/load", "RepositoryModelLoad"),
        ("POST", f"/v2/repository/models/{MODEL}/unload", "RepositoryModelUnload"),
    ],
)
def test_changing_calls_need_the_token(server: ServerProcess, method: str, path: str, action: str) -> None:
    before = metric(server, "sluicegate_auth_refused_total", action=action, reason="missing")
    wrong = metric(server, "sluicegate_auth_refused_total", action=action, reason="wrong")
    assert server.http(method, path, json={"weights": {"1": 1}}).status_code == 401
    headers = {"Authorization": "Bearer nope"}
    assert server.http(method, path, json={"weights": {"1": 1}}, headers=headers).status_code == 401
    assert metric(server, "sluicegate_auth_refused_total", action=action, reason="missing") == before + 1
    assert metric(server, "sluicegate_auth_refused_total", action=action, reason="wrong") == wrong + 1
    assert server.http("GET", "/health/ready").status_code == 200  # nothing was unloaded


def test_load_refuses_config_and_file_parameters(server: ServerProcess) -> None:
    path = f"/v2/repository/models/{MODEL}/load"
    for parameters in ({"config": "{}"}, {"file:1/model.onnx": "AAAA"}):
        answer = server.http("POST", path, json={"parameters": parameters}, headers=AUTH)
        assert answer.status_code == 400 and "not supported" in answer.json()["error"]


# --- malformed input ---------------------------------------------------------------------------------

MALFORMED = [
    b"",
    b"null",
    b"[]",
    b"{",
    b"\xff\xfe{}",
    b'{"inputs": 5}',
    b'{"inputs": [5]}',
    b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [1e400]}]}',
    b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": "x"}]}',
    b'{"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}',
    b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [true], "data": [1]}]}',
    b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [' + b"9" * 5000 + b"]}]}",
    b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [0, 3, 32, 32], "data": []}]}',
    b'{"inputs": [], "outputs": [{"name": 5}]}',
    b'{"inputs": [], "parameters": {"binary_data_output": [1]}}',
    b'{"id": 5, "inputs": []}',
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_input_is_never_a_500(server: ServerProcess, body: bytes) -> None:
    for path in (INFER, f"/v2/models/{MODEL}/infer"):
        answer = server.http("POST", path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
        assert "error" in answer.json()
    for header in ("abc", "-1", "999999", "0"):
        answer = server.http(
            "POST", INFER, content=body, headers={"Inference-Header-Content-Length": header}, timeout=10
        )
        assert 400 <= answer.status_code < 500, (header, answer.status_code, answer.text[:300])
    assert_no_traceback(server)


def test_unknown_routes_and_methods_answer_json(server: ServerProcess) -> None:
    answer = server.http("GET", "/nope")
    assert answer.status_code == 404 and "no route" in answer.json()["error"]
    answer = server.http("DELETE", INFER)
    assert answer.status_code == 405 and "error" in answer.json()
    server.assert_recovered("malformed requests")


# --- TLS ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls_server(repo: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {
        "ADMIN_TOKEN": TOKEN,
        "TLS_CERT_FILE": str(pki.server.cert),
        "TLS_KEY_FILE": str(pki.server.key),
        "TLS_CLIENT_CA_FILE": str(pki.ca),
    }
    process = ServerProcess(repo, tmp_path_factory.mktemp("mtls"), env, verify=pki.client_context())
    yield process
    process.stop()


def test_mutual_tls_needs_a_client_certificate(mtls_server: ServerProcess, pki: Pki) -> None:
    url = mtls_server.base_url
    assert url.startswith("https://")
    assert httpx.get(url + "/v2/health/ready", verify=pki.client_context()).status_code == 200
    answer = httpx.post(url + INFER, json=infer_body(), verify=pki.client_context(), timeout=30)
    assert answer.status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/v2/health/ready", verify=pki.client_context(with_cert=False))
    stranger = pki.client_context(with_cert=False)
    stranger.load_cert_chain(str(pki.stranger.cert), str(pki.stranger.key))
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/v2/health/ready", verify=stranger)
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
        httpx.get(url.replace("https://", "http://") + "/v2/health/ready")
    assert re.search(r"Traceback", mtls_server.log_text()) is None
    mtls_server.assert_recovered("TLS clients without a valid certificate")
