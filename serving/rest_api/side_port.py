"""The HTTP side port: liveness/readiness for probes, /metrics for Prometheus, the V2 REST routes for
debugging with curl (converted in serving/rest_api/converters.py), and the authenticated admin route that
sets traffic weights (the local canary).

The standard library's threading HTTP server is enough here: this port carries probes, scrapes and
the odd debugging request, not the inference traffic (that is gRPC), and it keeps the image light.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.dataplane import DataPlane
from serving.errors import InvalidInput, ServingError, Unauthenticated
from serving.observability.metrics import ServerMetrics
from serving.rest_api.converters import metadata_to_json, request_from_json, response_to_binary, response_to_json

log = logging.getLogger(__name__)

_MODEL = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<rest>/ready|/infer|/traffic)?$")
MAX_BODY = 100 * 1024 * 1024
BINARY_HEADER = "Inference-Header-Content-Length"  # Triton's binary tensor data extension


class SidePort:
    def __init__(
        self,
        dataplane: DataPlane,
        metrics: ServerMetrics,
        *,
        host: str,
        port: int,
        admin_token: str | None,
        server_name: str,
        server_version: str = "0",
    ) -> None:
        handler = type("Handler", (_Handler,), {"side": self})
        self.dataplane, self.metrics, self.admin_token = dataplane, metrics, admin_token
        self.server_name, self.server_version = server_name, server_version
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="http-side-port", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    side: SidePort
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def _handle(self, method: str) -> None:
        self._extra_headers: dict[str, str] = {}
        try:
            status, body, content_type = self._route(method, self.path.split("?", 1)[0])
        except ServingError as exc:
            status, body, content_type = exc.http_status, _json({"error": str(exc)}), "application/json"
        except Exception:
            log.exception("HTTP %s %s failed", method, self.path)
            status, body, content_type = 500, _json({"error": "internal error; see the server log"}), "application/json"
        self.send_response(status)
        for key, value in self._extra_headers.items():
            self.send_header(key, value)
        self._extra_headers = {}
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method: str, path: str) -> tuple[int, bytes, str]:
        plane = self.side.dataplane
        if method == "GET" and path in ("/health/live", "/v2/health/live"):
            return _status(plane.live(), "live")
        if method == "GET" and path in ("/health/ready", "/v2/health/ready"):
            return _status(plane.ready(), "ready")
        if method == "GET" and path == "/metrics":
            return 200, generate_latest(self.side.metrics.registry), CONTENT_TYPE_LATEST
        if method == "GET" and path == "/v2":
            return (
                200,
                _json({"name": self.side.server_name, "version": self.side.server_version, "extensions": []}),
                "application/json",
            )
        match = _MODEL.match(path)
        if match is None:
            return 404, _json({"error": f"no route {method} {path}"}), "application/json"
        name, version, rest = match["name"], match["version"] or "", match["rest"] or ""
        if rest == "/traffic":
            return self._traffic(method, name, version)
        if method == "GET" and rest == "/ready":
            return _status(plane.model_ready(name, version), "ready")
        if method == "GET" and not rest:
            meta = plane.metadata(name, version)
            return 200, _json(metadata_to_json(meta)), "application/json"
        if method == "POST" and rest == "/infer":
            return self._infer(name, version)
        return 405, _json({"error": f"{method} not allowed on {path}"}), "application/json"

    def _infer(self, name: str, version: str) -> tuple[int, bytes, str]:
        header = self.headers.get(BINARY_HEADER)
        if header is None:
            request = request_from_json(name, version, self._body())
        else:
            raw = self._raw_body()
            try:
                split = int(header)
            except ValueError as exc:
                raise InvalidInput(f"{BINARY_HEADER} {header!r} is not a byte count") from exc
            if not 0 <= split <= len(raw):
                raise InvalidInput(f"{BINARY_HEADER} {split} is outside the {len(raw)}-byte body")
            request = request_from_json(name, version, _parse_json(raw[:split]), binary=raw[split:])
        response = self.side.dataplane.infer(request)
        if request.raw_output:
            body, split = response_to_binary(response)
            self._extra_headers = {BINARY_HEADER: str(split)}
            return 200, body, "application/octet-stream"
        return 200, _json(response_to_json(response)), "application/json"

    def _traffic(self, method: str, name: str, version: str) -> tuple[int, bytes, str]:
        if version:
            raise InvalidInput("traffic weights are per model: use /v2/models/<name>/traffic without a version")
        self._authorise()
        plane = self.side.dataplane
        if method == "GET":
            return 200, _json({"model_name": name, "weights": plane.weights(name)}), "application/json"
        if method in ("PUT", "POST"):
            body = self._body()
            weights = body.get("weights")
            if not isinstance(weights, dict) or not all(isinstance(v, int) for v in weights.values()):
                raise InvalidInput('body must be {"weights": {"<version>": <integer weight>, ...}}')
            return 200, _json({"model_name": name, "weights": plane.set_weights(name, weights)}), "application/json"
        return 405, _json({"error": f"{method} not allowed on traffic"}), "application/json"

    def _authorise(self) -> None:
        token = self.side.admin_token
        if not token:
            raise Unauthenticated("admin calls are disabled: set SLUICEGATE_SERVING__ADMIN_TOKEN on the server")
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthenticated("admin call without the right bearer token (Authorization: Bearer <token>)")

    def _raw_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise InvalidInput(f"request body of {length} bytes is over the {MAX_BODY} byte limit")
        return self.rfile.read(length)

    def _body(self) -> dict[str, Any]:
        return _parse_json(self._raw_body())


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise InvalidInput(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object")
    return body


def _status(ok: bool, what: str) -> tuple[int, bytes, str]:
    # The status code is what probes read; the JSON body is what KServe's REST client parses.
    return (200 if ok else 503), _json({what: ok}), "application/json"


def _json(payload: Any) -> bytes:
    return json.dumps(payload, default=str).encode()
