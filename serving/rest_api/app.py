"""The side port's routes as a Starlette (ASGI) application, served by uvicorn (serving/rest_api/side_port.py).

Every request body is read here, chunk by chunk, against three limits that hold while it arrives, not
after: ``http_max_body_bytes`` (a declared Content-Length over it is refused before a byte is read, a
chunked body as soon as it passes it: 413), ``http_body_timeout_s`` between two pieces of body (408,
connection closed), and the content type of the route (415). Routes that name a model look it up
before reading the body, so a 95 MiB body for an unknown model is answered 404 unread.

The data plane blocks (inference waits on its batcher), so every call into it runs on Starlette's
thread pool; the event loop only moves bytes. Errors: a ``ServingError`` answers its HTTP status
(serving/errors.py), anything else 500 with a generic message and its traceback in the log; every
answer is JSON ``{"error": "..."}`` and every request value a message echoes is cut to
``max_echo_chars``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.auth import Authorizer
from serving.dataplane import DataPlane
from serving.errors import BodyRefused, ClientGone, InvalidInput, ModelNotFound, ServingError
from serving.observability.metrics import ServerMetrics
from serving.rest_api.converters import (
    config_to_json,
    echo,
    metadata_to_json,
    parse_json,
    request_from_json,
    response_to_binary,
    response_to_json,
    stats_to_json,
)
from serving.settings import ServingSettings
from serving.traffic import MAX_ENTRIES, MAX_WEIGHT

log = logging.getLogger(__name__)

BINARY_HEADER = "Inference-Header-Content-Length"  # Triton's binary tensor data extension
# Longest request target (path + query). Names are short; h11 refuses a head over 16 KiB anyway, this
# answers the merely long ones with a status that says why.
MAX_TARGET_BYTES = 2048
# Admin bodies (weights, load/unload parameters, index filter) are a few lines of JSON.
ADMIN_BODY_BYTES = 64 * 1024
JSON_TYPES = "application/json"
BINARY_TYPES = "application/json, or application/octet-stream with the Inference-Header-Content-Length header"

Handler = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")


def error_response(status: int, message: str, *, close: bool = False) -> JSONResponse:
    # "Connection: close" when the body was left unread: the next bytes would be parsed as a request.
    return JSONResponse({"error": message}, status_code=status, headers={"Connection": "close"} if close else None)


class RestApp:
    """The routes over a data plane; ``asgi`` is what uvicorn serves."""

    def __init__(
        self,
        plane: DataPlane,
        metrics: ServerMetrics,
        auth: Authorizer,
        settings: ServingSettings,
        *,
        server_name: str,
        server_version: str,
    ) -> None:
        self.plane, self.metrics, self.auth, self.settings = plane, metrics, auth, settings
        self.server_name, self.server_version = server_name, server_version
        self.echo_limit = settings.max_echo_chars
        model = "/v2/models/{name}"
        version = model + "/versions/{version}"
        routes = [
            Route("/health/live", self._guard(self.live), methods=["GET"]),
            Route("/v2/health/live", self._guard(self.live), methods=["GET"]),
            Route("/health/ready", self._guard(self.ready), methods=["GET"]),
            Route("/v2/health/ready", self._guard(self.ready), methods=["GET"]),
            Route("/metrics", self._guard(self.prometheus), methods=["GET"]),
            Route("/v2", self._guard(self.server_metadata), methods=["GET"]),
            Route("/v2/repository/index", self._guard(self.repository_index), methods=["POST"]),
            Route("/v2/repository/models/{name}/load", self._guard(self.load), methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self._guard(self.unload), methods=["POST"]),
        ]
        for prefix in (model, version):
            routes += [
                Route(prefix, self._guard(self.model_metadata), methods=["GET"]),
                Route(prefix + "/ready", self._guard(self.model_ready), methods=["GET"]),
                Route(prefix + "/config", self._guard(self.model_config), methods=["GET"]),
                Route(prefix + "/stats", self._guard(self.model_stats), methods=["GET"]),
                Route(prefix + "/infer", self._guard(self.infer), methods=["POST"]),
                Route(prefix + "/traffic", self._guard(self.traffic), methods=["GET", "PUT", "POST"]),
            ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
        self.asgi: ASGIApp = _TargetGuard(app)

    # -- plumbing --------------------------------------------------------------------------------

    def _guard(self, handler: Handler) -> Handler:
        """The one place errors become answers: never a traceback to the client, always one in the log."""

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientGone:
                return Response(status_code=499)  # never sent: uvicorn drops answers to closed connections
            except BodyRefused as exc:
                return error_response(exc.http_status, str(exc), close=exc.close)
            except ServingError as exc:
                return error_response(exc.http_status, str(exc))
            except Exception:
                log.exception("HTTP %s %s failed", request.method, echo(request.url.path, self.echo_limit))
                return error_response(500, "internal error; see the server log")

        return guarded

    def _name(self, request: Request, key: str = "name") -> str:
        """A path parameter (model name or version). One longer than ``max_echo_chars`` is looked up here
        and refused with a shortened echo, since the data plane's messages quote names whole."""
        value = str(request.path_params.get(key, ""))
        if len(value) > self.echo_limit:
            name = str(request.path_params.get("name", ""))
            found = self.plane.model_ready(value) if key == "name" else self.plane.model_ready(name, value)
            if not found:
                what = "model" if key == "name" else "version"
                raise ModelNotFound(f"{what} {echo(value, self.echo_limit)} ({len(value)} characters) is not loaded")
        return value

    def _peer(self, request: Request) -> str:
        client = request.client
        return f"{client.host}:{client.port}" if client else "unknown peer"

    async def _body(self, request: Request, limit: int) -> bytearray:
        """The whole body, refused as soon as it passes ``limit`` or stalls for ``http_body_timeout_s``."""
        declared = request.headers.get("content-length")
        # h11 has already refused a Content-Length that is not digits (400) before the app runs.
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyRefused(413, f"request body of {declared} bytes is over the {limit}-byte limit", close=True)
        body = bytearray()
        timeout = self.settings.http_body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(request.receive(), timeout)
            except TimeoutError:
                raise BodyRefused(408, f"no request body data for {timeout:g} s; closing", close=True) from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            body += message.get("body", b"")
            if len(body) > limit:
                raise BodyRefused(413, f"request body is over the {limit}-byte limit", close=True)
            if not message.get("more_body", False):
                return body

    def _content_type(self, request: Request, *, infer: bool = False) -> None:
        """No content type (curl -d, Triton's client) or JSON; on inference also octet-stream with the
        binary header."""
        given = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        binary = infer and BINARY_HEADER.lower() in request.headers
        if not given or given == "application/json" or (binary and given == "application/octet-stream"):
            return
        accepted = BINARY_TYPES if infer else JSON_TYPES
        raise BodyRefused(
            415, f"content type {echo(given, self.echo_limit)} is not accepted here; send {accepted}", close=True
        )

    async def _json_body(self, request: Request, limit: int = ADMIN_BODY_BYTES) -> dict[str, Any]:
        self._content_type(request)
        raw = await self._body(request, limit)
        return await in_pool(parse_json, raw, self.settings.http_max_json_depth)

    # -- health, metrics, metadata ---------------------------------------------------------------

    # Health runs on the event loop, not the pool: probes must answer while every pool thread waits on
    # inference (the data plane's lock is only held for dictionary updates).
    async def live(self, request: Request) -> Response:
        return _status(self.plane.live(), "live")

    async def ready(self, request: Request) -> Response:
        return _status(self.plane.ready(), "ready")

    async def prometheus(self, request: Request) -> Response:
        text = await in_pool(generate_latest, self.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": self.server_name, "version": self.server_version, "extensions": []})

    async def model_metadata(self, request: Request) -> Response:
        name, version = self._name(request), self._name(request, "version")
        meta = await in_pool(self.plane.metadata, name, version)
        return JSONResponse(metadata_to_json(meta))

    async def model_config(self, request: Request) -> Response:
        """Triton's model configuration extension."""
        name, version = self._name(request), self._name(request, "version")
        return JSONResponse(config_to_json(await in_pool(self.plane.config, name, version)))

    async def model_stats(self, request: Request) -> Response:
        """Triton's statistics extension."""
        name, version = self._name(request), self._name(request, "version")
        return JSONResponse(stats_to_json(await in_pool(self.plane.stats, name, version)))

    async def model_ready(self, request: Request) -> Response:
        name, version = self._name(request), self._name(request, "version")
        return _status(await in_pool(self.plane.model_ready, name, version), "ready")

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        """Counted in the same metrics as gRPC: the routed version when known, else the one requested."""
        start = time.perf_counter()
        name, version = str(request.path_params["name"]), str(request.path_params.get("version", ""))
        served, code = version, "OK"
        try:
            self._name(request)
            self._name(request, "version")
            # Looked up before the body is read: an unknown model costs no body, however large.
            loaded = await in_pool(self.plane.route, name, version)
            served = loaded.version
            header = request.headers.get(BINARY_HEADER)
            self._content_type(request, infer=True)
            raw = await self._body(request, self.settings.http_max_body_bytes)
            body, split, response = await in_pool(self._infer_sync, name, version, raw, header)
            served = response.model_version
        except ServingError as exc:  # BodyRefused and ClientGone carry their gRPC names too
            code = exc.code.name
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self.metrics.observe(name, served, code, time.perf_counter() - start)
        if split is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type="application/octet-stream", headers={BINARY_HEADER: str(split)})

    def _infer_sync(self, name: str, version: str, raw: bytearray, header: str | None) -> tuple[bytes, int | None, Any]:
        """Parse, convert, infer and encode, on a pool thread; (body, binary header length or None, response)."""
        depth, limit = self.settings.http_max_json_depth, self.echo_limit
        if header is None:
            parsed, binary = parse_json(raw, depth), memoryview(b"")
        else:
            if not header.isdigit() or int(header) > len(raw):
                raise InvalidInput(
                    f"{BINARY_HEADER} {echo(header, limit)} is not a byte count within the {len(raw)}-byte body"
                )
            split = int(header)
            view = memoryview(raw)
            parsed, binary = parse_json(view[:split], depth), view[split:]
        request = request_from_json(
            name, version, parsed, max_elements=self.settings.max_elements, binary=binary, max_echo_chars=limit
        )
        response = self.plane.infer(request)
        if request.raw_output:
            body, split = response_to_binary(response)
            return body, split, response
        return _json_bytes(response_to_json(response)), None, response

    # -- admin: traffic weights and the repository extension --------------------------------------

    async def traffic(self, request: Request) -> Response:
        name = self._name(request)
        if request.path_params.get("version"):
            raise InvalidInput("traffic weights are per model: use /v2/models/<name>/traffic without a version")
        given, peer = request.headers.get("authorization"), self._peer(request)
        if request.method == "GET":
            self.auth.read(given, peer=peer, action="GetTrafficWeights")
            weights = await in_pool(self.plane.weights, name)
            return JSONResponse({"model_name": name, "weights": weights})
        # Authorised before the body is read: an anonymous caller gets 401 for the headers alone.
        self.auth.change(given, peer=peer, action="SetTrafficWeights")
        wanted = weights_from_json(await self._json_body(request), self.echo_limit)
        result = await in_pool(self.plane.set_weights, name, wanted)
        log.info("traffic weights of %s set to %s by %s", name, result, peer)
        return JSONResponse({"model_name": name, "weights": result})

    async def repository_index(self, request: Request) -> Response:
        self.auth.read(request.headers.get("authorization"), peer=self._peer(request), action="RepositoryIndex")
        body = await self._json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"'ready' is {echo(ready, self.echo_limit)}; expected true or false")
        entries = await in_pool(self.plane.index)
        return JSONResponse(
            [
                {"name": e.name, "version": e.version, "state": e.state, "reason": e.reason}
                for e in entries
                if not ready or e.state == "READY"
            ]
        )

    async def load(self, request: Request) -> Response:
        return await self._repository_change(request, "RepositoryModelLoad", self.plane.load_model, "loaded")

    async def unload(self, request: Request) -> Response:
        return await self._repository_change(request, "RepositoryModelUnload", self.plane.unload_model, "unloaded")

    async def _repository_change(
        self, request: Request, action: str, change: Callable[[str], None], done: str
    ) -> Response:
        peer = self._peer(request)
        self.auth.change(request.headers.get("authorization"), peer=peer, action=action)
        name = self._name(request)
        body = await self._json_body(request)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, Mapping):
            raise InvalidInput(f"'parameters' is {echo(parameters, self.echo_limit)}; expected a JSON object")
        # Triton's load can carry a config or model files; this server only loads what its repository
        # holds (verified against SHA256SUMS), so a caller can never place files on it.
        foreign = [key for key in parameters if key == "config" or str(key).startswith("file:")]
        if foreign:
            raise InvalidInput(
                f"{action}: parameters {echo(foreign, self.echo_limit)} are not supported; models load only from "
                "the server's repository"
            )
        await in_pool(change, name)
        log.info("model %s %s on request from %s", name, done, peer)
        return JSONResponse({})


def weights_from_json(body: Mapping[str, Any], limit: int) -> dict[str, int]:
    """``{"weights": {"<version>": <int 0..MAX_WEIGHT>, ...}}``, at most ``MAX_ENTRIES`` entries.

    JSON allows what a weight must not be: a float (even an integral one), true/false (Python bools are
    ints), 10**400 (Python parses any integer)."""
    weights = body.get("weights")
    usage = f'body must be {{"weights": {{"<version>": <integer weight 0..{MAX_WEIGHT}>, ...}}}}'
    if not isinstance(weights, Mapping):
        raise InvalidInput(f"{usage}; 'weights' is {echo(weights, limit)}")
    if len(weights) > MAX_ENTRIES:
        raise InvalidInput(f"{usage}; got {len(weights)} entries, expected at most {MAX_ENTRIES}")
    for version, weight in weights.items():
        if len(version) > limit:
            raise InvalidInput(f"{usage}; version {echo(version, limit)} has {len(version)} characters")
        if not isinstance(weight, int) or isinstance(weight, bool):
            raise InvalidInput(f"{usage}; version {echo(version, limit)} has weight {echo(weight, limit)}")
        if not 0 <= weight <= MAX_WEIGHT:
            shown = weight if abs(weight) < 10**15 else f"a {math.floor(math.log10(abs(weight))) + 1}-digit number"
            raise InvalidInput(f"{usage}; version {echo(version, limit)} has weight {shown}")
    return dict(weights)


async def in_pool(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on Starlette's thread pool, leaving no request behind on the thread.

    anyio's worker thread keeps its last result or exception until its next job; an exception keeps
    its traceback, which grows with every frame it then unwinds through here (the route's, holding the
    body). A refused 4 MiB body stayed alive per idle thread (the RSS probe grew 8 MiB a request). So
    the outcome comes back in a list emptied here, with the thread's frames cleared."""
    outcome = await run_in_threadpool(_shed, fn, *args)
    ok, value = outcome
    outcome.clear()
    if ok:
        return cast(T, value)
    try:
        raise value
    finally:
        del value  # the frame must not hold the exception whose traceback holds the frame


def _shed(fn: Callable[..., Any], *args: Any) -> list[Any]:
    try:
        return [True, fn(*args)]
    except Exception as exc:
        traceback.clear_frames(exc.__traceback__)
        return [False, exc]


class _TargetGuard:
    """Refuses an over-long request target (414) before routing, so no route echoes or matches it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
            if size > MAX_TARGET_BYTES:
                message = f"request target of {size} bytes is over the {MAX_TARGET_BYTES}-byte limit"
                await error_response(414, message, close=True)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Starlette's own 404 (no route) and 405 (wrong method), as JSON like every other error.
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    path = echo(request.url.path, 64)
    message = f"no route {request.method} {path}" if status == 404 else f"{detail}: {request.method} {path}"
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _status(ok: bool, what: str) -> Response:
    # The status code is what probes read; the JSON body is what KServe's REST client parses.
    return JSONResponse({what: ok}, status_code=200 if ok else 503)


def _json_bytes(payload: Any) -> bytes:
    # Not JSONResponse: its allow_nan=False would turn a NaN output into a 500.
    return json.dumps(payload, default=str).encode()
