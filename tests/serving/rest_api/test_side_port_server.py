"""The side port's uvicorn server (serving/rest_api/side_port.py ``QuietServer``): housekeeping once a second
instead of ten times, the Date header still set, and a stop that does not wait for the next tick."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from serving.rest_api.side_port import QuietServer


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def test_the_quiet_server_serves_with_a_date_and_stops_without_waiting_for_its_tick() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    server = QuietServer(uvicorn.Config(hello, lifespan="off", log_config=None, access_log=False))
    server.TICK_S = 60.0  # a stop that waited for the tick would take a minute
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        answer = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert answer.status_code == 200 and answer.text == "hello"
        assert answer.headers.get("date", "").endswith("GMT")
    finally:
        asked = time.monotonic()
        server.exit_soon()
        thread.join(30)
        listener.close()
    assert not thread.is_alive()
    assert time.monotonic() - asked < 20, "exit_soon() must wake the loop, not wait for its 60 s tick"
