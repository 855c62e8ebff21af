"""The HTTP side port: liveness/readiness for probes, /metrics for Prometheus, the V2 REST routes
(inference, metadata, Triton's repository extension) and the authenticated traffic route, served by
uvicorn on its own thread and event loop; the routes are in serving/rest_api/app.py.

Why uvicorn rather than the standard library's ThreadingHTTPServer: the stdlib server spends a thread
per connection, has no limit on connections, no timeout on headers or bodies, trusts Content-Length
and reads the body only after the handler asked for it, so 200 stalled clients held 200 threads and a
single request could pin 100 MiB. uvicorn (h11) parses strictly (a malformed Content-Length is a 400
before the app runs), holds an idle connection in a few KiB rather than a thread, and gives
limit_concurrency, keep-alive timeouts, graceful shutdown and TLS.

What uvicorn does not do, done here: a deadline for the request head. Its h11 protocol arms a timer
only between keep-alive requests, so a client that sends half a request line and stalls (slowloris)
keeps its connection for ever; ``_DeadlineProtocol`` closes any connection whose head is not complete
``http_header_timeout_s`` after it started. The body timeout and size limit are the app's (app.py),
since only it knows when it is waiting for body data.

And a lingering close (nginx's ``lingering_close``): uvicorn closes the socket right after an answer that
refuses a body the client is still sending (413, 408, 415), and closing with unread data makes the kernel
send a reset at once, which can overtake the answer on its way (CI saw a 413 arrive without its body).
``_LingeringClose`` half-closes instead, so the answer is followed by an orderly end of stream, then
reads and drops what the client still sends for at most ``LINGER_S`` and ``LINGER_BYTES`` before it
closes: the client reads its answer, and the cost of a hostile sender stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.auth import Authorizer
from serving.dataplane import DataPlane
from serving.observability.metrics import ServerMetrics
from serving.rest_api.app import BINARY_HEADER, RestApp
from serving.settings import ServingSettings

__all__ = ["BINARY_HEADER", "SidePort"]

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0
LINGER_S = 2.0  # nginx's lingering_timeout is 5 s; a client that reads its answer closes within ms
LINGER_BYTES = 8 << 20


class QuietServer(uvicorn.Server):
    """uvicorn's server with its housekeeping tick (the Date header, the exit check) once a second instead
    of ten times: an idle side port cost 0.25 % of a core, and under load each tick preempts the inference
    thread. ``exit_soon()`` wakes the loop at once, so stopping is no slower than uvicorn's own tick.

    Overrides ``main_loop``, which uvicorn does not document as an extension point: where a later uvicorn
    lacks ``on_tick``, uvicorn's own loop runs (tests/serving/rest_api check the port starts and stops)."""

    TICK_S = 1.0

    async def main_loop(self) -> None:
        if not hasattr(self, "on_tick"):
            await super().main_loop()
            return
        self._exit_event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864_000  # on_tick refreshes the Date header when counter % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_event.wait(), self.TICK_S)
            should_exit = await self.on_tick(counter)

    def exit_soon(self) -> None:
        """Stop (from any thread): as ``should_exit = True``, without waiting for the next tick."""
        self.should_exit = True
        loop, event = getattr(self, "_loop", None), getattr(self, "_exit_event", None)
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between: it has stopped already
                loop.call_soon_threadsafe(event.set)


class _LingeringClose:
    """The transport uvicorn's protocol writes to, with ``close()`` turned into a lingering close while the
    client is still sending a request body (``still_sending``); everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, still_sending: Any) -> None:
        self._transport, self._loop, self._still_sending = transport, loop, still_sending
        self.lingering = False
        self.dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.lingering:  # nothing may follow the end of stream
            self._transport.write(data)

    def close(self) -> None:
        transport = self._transport
        if self.lingering or transport.is_closing() or not self._still_sending() or not transport.can_write_eof():
            self.close_now()
            return
        self.lingering = True
        transport.write_eof()  # after what is buffered: the answer, then the end of stream
        transport.resume_reading()  # uvicorn may have paused it for the unread body: drain it now
        self._timer = self._loop.call_later(LINGER_S, self.close_now)

    def drop(self, data: bytes) -> None:
        """Body bytes that arrived while lingering: counted, never kept."""
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self.close_now()

    def close_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.close()


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module docstring)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Before uvicorn's own setup: its flow control and request cycles keep the transport they are given.
        self._lingering = _LingeringClose(transport, self.loop, lambda: self.conn.their_state is h11.SEND_BODY)
        super().connection_made(self._lingering)  # type: ignore[arg-type]
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering.lingering:
            self._lingering.drop(data)
            return
        super().data_received(data)
        # IDLE: the request line and headers are not complete yet (h11 emits Request once they are).
        # The deadline counts from the first byte of a head, never reset by more bytes: a client
        # trickling one byte a second must not keep the connection.
        if self.conn.their_state is h11.IDLE:
            if self._head_deadline is None:
                self._arm()
        elif self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering.lingering:
            self._lingering.close_now()  # the client went first: stop the linger timer
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        if not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown peer"
            log.info("closing HTTP connection from %s: no complete request head in %g s", peer, self.header_timeout_s)
            self.transport.close()


class SidePort:
    """The side port: bound at construction (``port`` is known at once, 0 picks a free one), serving
    after ``start()``, draining in-flight requests on ``stop()``."""

    def __init__(
        self,
        dataplane: DataPlane,
        metrics: ServerMetrics,
        *,
        host: str,
        port: int,
        auth: Authorizer,
        server_name: str,
        server_version: str = "0",
        settings: ServingSettings | None = None,
    ) -> None:
        settings = settings if settings is not None else ServingSettings()
        self.dataplane, self.metrics, self.auth, self.settings = dataplane, metrics, auth, settings
        self.app = RestApp(dataplane, metrics, auth, settings, server_name=server_name, server_version=server_version)
        # Bound here, not by uvicorn: the port must be known (and taken) before start() returns.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # reuse_port: the workers of one supervisor share the port (the kernel spreads connections).
        self._socket = socket.create_server((host, port), family=family, backlog=2048, reuse_port=settings.reuse_port)
        self.port = int(self._socket.getsockname()[1])
        protocol = type("SidePortProtocol", (_DeadlineProtocol,), {"header_timeout_s": settings.http_header_timeout_s})
        tls: dict[str, Any] = {}
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            tls = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
            if settings.tls_client_ca_file is not None:
                tls |= {"ssl_ca_certs": str(settings.tls_client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            self.app.asgi,
            http=protocol,
            lifespan="off",
            log_config=None,  # the process's logging (JSON lines) stays as server.main() set it
            access_log=False,
            server_header=False,
            timeout_keep_alive=settings.http_keepalive_s,  # type: ignore[arg-type]  # a float works (call_later)
            limit_concurrency=settings.http_max_connections,
            timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
            **tls,
        )
        self.server = QuietServer(config)
        self._thread = threading.Thread(target=self._run, name="http-side-port", daemon=True)
        self._failure: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._failure = exc
            log.exception("HTTP side port failed")

    def start(self) -> None:
        """Serve; returns once uvicorn accepts on the port (raises if it could not start)."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP side port did not start on port {self.port}") from self._failure
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to drain_timeout_s), close the port."""
        self.server.exit_soon()
        if self._thread.is_alive():
            self._thread.join(self.settings.drain_timeout_s + 5)
        self._socket.close()
