"""The bridge core: a message in, each new object version out exactly once, the rest set aside.

Sources (SQS, webhook) hand raw message bodies to :meth:`Bridge.handle`; what it returns tells the
source whether the message can be acknowledged.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from flows.events.records import S3ObjectEvent, parse_message
from flows.events.sink import EventSink
from sluicegate.errors import EventError
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.events import claim_s3_event, mark_s3_event_emitted, record_dead_letter

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    HANDLED = "handled"  # every record emitted now or earlier: acknowledge the message
    MALFORMED = "malformed"  # set aside in the dead letters: acknowledge, never retry as-is
    RETRY = "retry"  # the sink or the store failed: leave the message for redelivery


@dataclass(frozen=True)
class Handled:
    outcome: Outcome
    emitted: int = 0
    duplicates: int = 0
    ignored: int = 0
    error: str | None = None


class Bridge:
    def __init__(self, store: MetadataStore, sink: EventSink) -> None:
        self._store = store
        self._sink = sink

    def handle(self, body: str, source: str) -> Handled:
        try:
            message = parse_message(body)
        except EventError as exc:
            return self._dead_letter(body, source, str(exc))
        for reason in message.ignored:
            log.info("not forwarded (%s): %s", source, reason)
        emitted = duplicates = 0
        try:
            for record in message.records:
                if self._forward(record, source):
                    emitted += 1
                else:
                    duplicates += 1
        except Exception as exc:  # the sink or the store is away: the source redelivers later
            log.warning("could not hand on a %s message, will retry: %s", source, exc)
            return Handled(Outcome.RETRY, emitted, duplicates, len(message.ignored), str(exc))
        return Handled(Outcome.HANDLED, emitted, duplicates, len(message.ignored))

    def _forward(self, record: S3ObjectEvent, source: str) -> bool:
        """Emit one record unless it was emitted before; True when emitted now."""
        with self._store.session() as session:
            row, _ = claim_s3_event(
                session,
                dedupe_key=record.dedupe_key,
                event_id=str(record.event_id),
                source=source,
                bucket=record.bucket,
                key=record.key,
                etag=record.etag,
                version_id=record.version_id,
                sequencer=record.sequencer,
                size=record.size,
                event_time=record.event_time,
            )
            already = row.emitted_at is not None
        if already:
            log.info("duplicate delivery of %s (etag %s) from %s: not emitted again", record.uri, record.etag, source)
            return False
        # A claim without emitted_at is a crash between claim and emit: emit again with the same id,
        # which Prefect's trigger service deduplicates.
        self._sink.emit([record])
        with self._store.session() as session:
            mark_s3_event_emitted(session, record.dedupe_key, datetime.now(UTC))
        log.info("emitted %s (etag %s, event %s) from %s", record.uri, record.etag, record.event_id, source)
        return True

    def _dead_letter(self, body: str, source: str, error: str) -> Handled:
        log.error("malformed %s message set aside in dead letters: %s", source, error)
        try:
            with self._store.session() as session:
                record_dead_letter(session, source=source, body=body, error=error)
        except Exception as exc:  # nowhere to set it aside: keep the message for redelivery
            log.warning("could not record a dead letter, will retry: %s", exc)
            return Handled(Outcome.RETRY, error=str(exc))
        return Handled(Outcome.MALFORMED, error=error)
