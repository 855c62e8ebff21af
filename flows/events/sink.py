"""Where normalised S3 events go: the Prefect events API."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

import httpx

from flows.events.records import S3ObjectEvent
from sluicegate.errors import EventError


class EventSink(Protocol):
    """Hands events on; returns only once the receiver has accepted them (or raises)."""

    def emit(self, events: Sequence[S3ObjectEvent]) -> None: ...


class PrefectEventSink:
    """POSTs events to a Prefect server's ``/events`` route.

    The HTTP route rather than ``prefect.events.emit_event``: emit_event queues the event on a
    background websocket worker and returns before the server has it, so the bridge could delete an
    SQS message whose event was never delivered. A 2xx here means the server has taken it.
    """

    def __init__(
        self,
        api_url: str,
        event_name: str,
        *,
        auth_string: str | None = None,
        api_key: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        headers = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        elif auth_string:
            headers["Authorization"] = "Basic " + base64.b64encode(auth_string.encode()).decode()
        self._url = api_url.rstrip("/") + "/events"
        self._event_name = event_name
        self._http = httpx.Client(timeout=timeout, headers=headers)

    def payload(self, event: S3ObjectEvent) -> dict[str, object]:
        return {
            "id": str(event.event_id),
            # When the bridge saw it: Prefect orders trigger evaluation by `occurred`, and a
            # notification can arrive late; the S3 time travels in the payload.
            "occurred": datetime.now(UTC).isoformat(),
            "event": self._event_name,
            "resource": event.resource(),
            "payload": {
                "event_name": event.event_name,
                "event_time": event.event_time.isoformat() if event.event_time else None,
                "size": event.size,
            },
        }

    def emit(self, events: Sequence[S3ObjectEvent]) -> None:
        if not events:
            return
        try:
            response = self._http.post(self._url, json=[self.payload(event) for event in events])
        except httpx.HTTPError as exc:
            raise EventError(f"Prefect events API at {self._url} is unreachable: {exc}") from exc
        if response.status_code >= 300:
            raise EventError(
                f"Prefect events API at {self._url} refused {len(events)} event(s): "
                f"HTTP {response.status_code} {response.text[:300]}"
            )

    def close(self) -> None:
        self._http.close()
