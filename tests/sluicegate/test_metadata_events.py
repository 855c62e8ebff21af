"""The event bridge's rows (S3 event claims, dead letters), on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.exc import NoResultFound

from sluicegate.metadata import MetadataStore, S3Event
from sluicegate.metadata.events import find_s3_event, mark_s3_event_emitted, record_dead_letter, s3_event_emitted_at
from tests.fixtures.metadata import claim, count


def test_claim_s3_event_only_once(store: MetadataStore) -> None:
    first, created = claim(store, "sluicegate/key/etag")
    again, created_again = claim(store, "sluicegate/key/etag", source="webhook")
    assert (created, created_again) == (True, False)
    assert again.id == first.id
    assert again.source == "sqs"  # the first claim's row, not the second's values
    assert again.event_id == first.event_id
    assert again.event_time == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert count(store, S3Event) == 1


def test_claim_s3_event_under_concurrency_creates_one_row(store: MetadataStore) -> None:
    results: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def worker() -> None:
        try:
            barrier.wait()
            results.append(claim(store, "contended")[1])
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == [False] * 5 + [True]
    assert count(store, S3Event) == 1


def test_claim_s3_event_validates_its_fields(store: MetadataStore) -> None:
    with pytest.raises(ValueError, match=r"source must be one of 'sqs', 'webhook', got 'kafka'"):
        claim(store, "k1", source="kafka")
    with pytest.raises(ValueError, match="event_id must be a UUID"):
        claim(store, "k2", event_id="not-a-uuid")
    with pytest.raises(ValueError, match="event_time must be timezone-aware"):
        claim(store, "k3", event_time=datetime(2026, 11, 29, 12, 0))
    assert count(store, S3Event) == 0


def test_event_times_come_back_in_utc(store: MetadataStore) -> None:
    plus_two = timezone(timedelta(hours=2))
    row, _ = claim(store, "tz", event_time=datetime(2026, 11, 29, 14, 0, tzinfo=plus_two))
    with store.session() as session:
        loaded = session.get(S3Event, row.id)
        assert loaded is not None and loaded.event_time is not None
        assert loaded.event_time.utcoffset() == timedelta(0)
        assert loaded.event_time == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_mark_s3_event_emitted(store: MetadataStore) -> None:
    claim(store, "emit-me")
    when = datetime(2026, 11, 29, 12, 0, 1, 500, tzinfo=UTC)
    with store.session() as session:
        mark_s3_event_emitted(session, "emit-me", when)
    with store.session() as session:
        row = session.scalars(select(S3Event).where(S3Event.dedupe_key == "emit-me")).one()
        assert row.emitted_at == when
        with pytest.raises(LookupError, match="no S3 event claimed under dedupe key 'missing'"):
            mark_s3_event_emitted(session, "missing", when)


def test_record_dead_letter(store: MetadataStore) -> None:
    with store.session() as session:
        row = record_dead_letter(session, source="sqs", body="{not json", error="Expecting property name")
    assert row.id is not None
    assert row.received_at.tzinfo is not None


def test_find_s3_event_and_when_it_was_emitted(store: MetadataStore) -> None:
    event_id = str(uuid.uuid4())
    first, _ = claim(store, "k1", event_id=event_id, key="datasets/pcb/a/manifest.csv")
    claim(store, "k2", event_id=event_id, key="datasets/pcb/b/manifest.csv")
    when = datetime(2026, 11, 29, 12, 0, 2, tzinfo=UTC)
    with store.session() as session:
        found = find_s3_event(session, event_id)
        assert found is not None and found.id == first.id  # the earliest claim under that id
        assert find_s3_event(session, str(uuid.uuid4())) is None
        assert s3_event_emitted_at(session, "datasets/pcb/a/manifest.csv") is None
        mark_s3_event_emitted(session, "k1", when)
    with store.session() as session:
        assert s3_event_emitted_at(session, "datasets/pcb/a/manifest.csv") == when
        with pytest.raises(NoResultFound):
            s3_event_emitted_at(session, "datasets/pcb/missing/manifest.csv")
