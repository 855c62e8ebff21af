"""Runs the bridge process: the configured sources plus the webhook/health server."""

from __future__ import annotations

import logging
import threading

from flows.events.bridge import Bridge
from flows.events.sink import PrefectEventSink
from flows.events.sources import EventSource, SqsSource
from flows.events.webhook import webhook_app
from sluicegate.metadata import MetadataStore
from sluicegate.settings import Settings

log = logging.getLogger(__name__)


def build_bridge(settings: Settings, store: MetadataStore) -> tuple[Bridge, PrefectEventSink]:
    prefect = settings.prefect
    sink = PrefectEventSink(
        prefect.url,
        settings.events.event_name,
        auth_string=prefect.auth_string.get_secret_value() if prefect.auth_string else None,
        api_key=prefect.api_key.get_secret_value() if prefect.api_key else None,
    )
    return Bridge(store, sink), sink


def serve(settings: Settings, host: str | None = None) -> None:
    """Run until interrupted (SIGINT/SIGTERM stop the HTTP server, then the pollers).

    The store stays open for the process's lifetime; its schema is checked once, on the way in.
    """
    with MetadataStore.checked(settings.metadata_url) as store:
        bridge, sink = build_bridge(settings, store)
        try:
            _run_sources(settings, bridge, host)
        finally:
            sink.close()


def _run_sources(settings: Settings, bridge: Bridge, host: str | None) -> None:
    """The SQS poller (when configured) in a thread, the webhook/health server in this one."""
    import uvicorn

    stop = threading.Event()
    sources: list[EventSource] = []
    threads = []
    if "sqs" in settings.events.sources:
        sqs = SqsSource(settings, bridge)
        sources.append(sqs)
        threads.append(threading.Thread(target=sqs.run, args=(stop,), name="sqs-source", daemon=True))
    token = settings.events.webhook_token.get_secret_value() if settings.events.webhook_token else None
    app = webhook_app(bridge, token, sources)
    for thread in threads:
        thread.start()
    try:
        uvicorn.run(
            app,
            host=host or settings.events.webhook_host,
            port=settings.events.webhook_port,
            log_level="warning",
            access_log=False,
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=settings.events.wait_seconds + 5)
