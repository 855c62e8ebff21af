"""The webhook source: POST /events takes one notification (S3 records, MinIO or EventBridge JSON).

Answers 200 when handed on, 400 when set aside as malformed (the sender must not retry), 503 when
the bridge cannot hand on now (the sender retries: MinIO and EventBridge both do).
"""

# No `from __future__ import annotations`: FastAPI reads these annotations at run time.
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from flows.events.bridge import Bridge, Outcome
from flows.events.sources import EventSource

_STATUS = {Outcome.HANDLED: 200, Outcome.MALFORMED: 400, Outcome.RETRY: 503}


def webhook_app(bridge: Bridge, token: str | None, sources: list[EventSource]) -> FastAPI:
    app = FastAPI(title="sluicegate event bridge", docs_url=None, redoc_url=None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "sources": ["webhook", *(source.name for source in sources)]}

    @app.post("/events")
    async def events(request: Request) -> JSONResponse:
        if token and request.headers.get("authorization") != f"Bearer {token}":
            return JSONResponse({"error": "missing or wrong bearer token (SLUICEGATE_EVENTS__WEBHOOK_TOKEN)"}, 401)
        body = (await request.body()).decode("utf-8", errors="replace")
        # The bridge does blocking I/O (store, Prefect API): keep it off the event loop.
        result = await run_in_threadpool(bridge.handle, body, "webhook")
        content: dict[str, Any] = {
            "outcome": result.outcome.value,
            "emitted": result.emitted,
            "duplicates": result.duplicates,
            "ignored": result.ignored,
        }
        if result.error:
            content["error"] = result.error
        return JSONResponse(content, _STATUS[result.outcome])

    return app
