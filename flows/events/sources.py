"""Event sources: SQS (long poll) here; the HTTP webhook (MinIO, EventBridge) is in webhook.py.

Each source turns its transport's messages into :meth:`Bridge.handle` calls and acknowledges only
what was handed on or set aside.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from botocore.exceptions import BotoCoreError, ClientError

from flows.events.bridge import Bridge, Outcome
from sluicegate import storage
from sluicegate.settings import Settings

log = logging.getLogger(__name__)


class EventSource(Protocol):
    name: str

    def run(self, stop: threading.Event) -> None:
        """Deliver messages to the bridge until ``stop`` is set."""


class SqsSource:
    """Long-polls the notification queue; deletes a message only after the bridge dealt with it.

    A malformed message is also copied to the dead-letter queue, where AWS tooling (redrive) can see
    it; a message the bridge could not hand on stays in the queue and comes back after the
    visibility timeout.
    """

    name = "sqs"

    def __init__(self, settings: Settings, bridge: Bridge) -> None:
        self._settings = settings
        self._bridge = bridge
        self._sqs = storage.sqs_client(settings)
        self._queue_url = storage.queue_url(settings, self._sqs)
        self._dlq_url = storage.queue_url(settings, self._sqs, name=settings.events.dead_letter_queue_name)
        self.received = 0

    def poll_once(self) -> int:
        """One receive call; returns how many messages arrived."""
        response = self._sqs.receive_message(
            QueueUrl=self._queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=self._settings.events.wait_seconds,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        messages = response.get("Messages", [])
        for message in messages:
            self.received += 1
            body = message.get("Body", "")
            result = self._bridge.handle(body, self.name)
            if result.outcome is Outcome.RETRY:
                continue
            if result.outcome is Outcome.MALFORMED:
                self._sqs.send_message(
                    QueueUrl=self._dlq_url,
                    MessageBody=body or "<empty>",
                    MessageAttributes={
                        "error": {"DataType": "String", "StringValue": (result.error or "malformed")[:1000]}
                    },
                )
            self._sqs.delete_message(QueueUrl=self._queue_url, ReceiptHandle=message["ReceiptHandle"])
        return len(messages)

    def run(self, stop: threading.Event) -> None:
        log.info("sqs source polling %s", self._queue_url)
        backoff = 1.0
        while not stop.is_set():
            try:
                self.poll_once()
                backoff = 1.0
            except (ClientError, BotoCoreError) as exc:
                # The endpoint away for a while must not end the bridge: back off and poll again.
                log.warning("SQS receive failed (%s); retrying in %.0f s", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
