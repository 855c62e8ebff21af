"""Repository functions for the event bridge: S3 event claims (``s3_events``) and dead letters (``dead_letters``).

A claim is keyed on the identity of the object write, so each write is emitted to Prefect once however
many times S3 delivers its notification.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import EVENT_SOURCES, DeadLetter, S3Event, utcnow
from sluicegate.metadata.rows import check_aware, check_choice, insert_ignore


def claim_s3_event(
    session: Session,
    *,
    dedupe_key: str,
    event_id: str,
    source: str,
    bucket: str,
    key: str,
    etag: str,
    version_id: str | None,
    sequencer: str | None,
    size: int | None,
    event_time: datetime | None,
) -> tuple[S3Event, bool]:
    """Record an incoming S3 event unless one with the same ``dedupe_key`` was recorded before.

    Safe with several bridge workers: the insert is ``ON CONFLICT DO NOTHING``, so exactly one claimant
    sees ``created=True`` and emits the Prefect event.

    Args:
        session: An open session.
        dedupe_key: Identity of the object write (bucket, key, ETag, and version id/sequencer when sent).
        event_id: The Prefect event id (a UUID) the bridge will emit for it.
        source: ``"sqs"`` or ``"webhook"``.
        bucket: Bucket of the object.
        key: Decoded object key.
        etag: ETag of the object.
        version_id: S3 version id; None when the notification has none.
        sequencer: S3 sequencer; None when the notification has none.
        size: Object size in bytes, if sent.
        event_time: When S3 saw the write (timezone-aware), if sent.

    Returns:
        ``(row, created)``: the recorded event (possibly an earlier claim's), and whether this call
        inserted it.

    Raises:
        ValueError: ``source`` is unknown, ``event_id`` is not a UUID, or ``event_time`` is naive.
    """
    check_choice("source", source, EVENT_SOURCES)
    check_aware("event_time", event_time)
    values = {
        "dedupe_key": dedupe_key,
        "event_id": _event_uuid(event_id),
        "source": source,
        "bucket": bucket,
        "key": key,
        "etag": etag,
        "version_id": version_id,
        "sequencer": sequencer,
        "size": size,
        "event_time": event_time,
        "received_at": utcnow(),
    }
    created = insert_ignore(session, S3Event, values, ("dedupe_key",))
    row = session.scalars(select(S3Event).where(S3Event.dedupe_key == dedupe_key)).one()
    return row, created


def mark_s3_event_emitted(session: Session, dedupe_key: str, when: datetime) -> None:
    """Note that the Prefect event for a claimed S3 event was emitted.

    Args:
        session: An open session.
        dedupe_key: The key the event was claimed under.
        when: Emission time (timezone-aware); a repeated call overwrites it.

    Raises:
        LookupError: no event was claimed under ``dedupe_key``.
        ValueError: ``when`` is naive.
    """
    check_aware("when", when)
    row = session.scalars(select(S3Event).where(S3Event.dedupe_key == dedupe_key)).one_or_none()
    if row is None:
        raise LookupError(f"no S3 event claimed under dedupe key {dedupe_key!r}; claim it first")
    row.emitted_at = when


def find_s3_event(session: Session, event_id: str) -> S3Event | None:
    """The first claim recorded under the Prefect event id ``event_id`` (what triggered a pipeline run).

    Args:
        session: An open session.
        event_id: The Prefect event id, as a pipeline run's ``trigger_event_id`` holds it.

    Returns:
        The earliest such claim, or None when the bridge recorded none (e.g. an event emitted by hand).
    """
    query = select(S3Event).where(S3Event.event_id == event_id).order_by(S3Event.id).limit(1)
    return session.scalars(query).first()


def s3_event_emitted_at(session: Session, key: str) -> datetime | None:
    """When the one event claimed for object ``key`` was emitted to Prefect (None: not yet).

    Args:
        session: An open session.
        key: The decoded object key.

    Raises:
        sqlalchemy.exc.NoResultFound: no event was claimed for ``key``.
        sqlalchemy.exc.MultipleResultsFound: several were (several writes of the key).
    """
    return session.scalars(select(S3Event.emitted_at).where(S3Event.key == key)).one()


def record_dead_letter(session: Session, *, source: str, body: str, error: str) -> DeadLetter:
    """Keep a message the bridge could not understand, with the reason.

    Args:
        session: An open session.
        source: Where it came from (``"sqs"``, ``"webhook"``).
        body: The raw message body.
        error: Why it was set aside.

    Returns:
        The new row (every call adds one: the same bad message arriving twice is two deliveries).
    """
    row = DeadLetter(source=source, body=body, error=error, received_at=utcnow())
    session.add(row)
    session.flush()
    return row


def _event_uuid(event_id: str) -> str:
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        raise ValueError(f"event_id must be a UUID (the Prefect event id), got {event_id!r}") from None
