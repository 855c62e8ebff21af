"""The bridge against real parts: moto's SQS, a Prefect server, the metadata store."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from sqlalchemy import func, select

from flows.events.bridge import Bridge, Outcome
from flows.events.service import build_bridge
from flows.events.sink import PrefectEventSink
from flows.events.sources import SqsSource
from flows.events.webhook import webhook_app
from sluicegate import storage
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.models import DeadLetter, S3Event
from sluicegate.settings import Settings
from tests.fixtures.services import free_port


def record(key: str, etag: str = "e-1", **extra: object) -> str:
    return json.dumps(
        {
            "Records": [
                {
                    "eventName": "ObjectCreated:Put",
                    "eventTime": "2026-11-29T10:00:00Z",
                    "s3": {"bucket": {"name": "sluicegate"}, "object": {"key": key, "size": 3, "eTag": etag, **extra}},
                }
            ]
        }
    )


def prefect_events(api: str, resource_id: str, timeout: float = 30.0, want: int = 1) -> list[dict[str, object]]:
    """Events the Prefect server stored for a resource (its persister writes in batches: poll)."""
    deadline = time.monotonic() + timeout
    events: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        response = httpx.post(
            f"{api}/events/filter",
            json={"filter": {"event": {"name": ["s3.object.created"]}, "resource": {"id": [resource_id]}}, "limit": 50},
        )
        response.raise_for_status()
        events = response.json()["events"]
        if len(events) >= want:
            return events
        time.sleep(0.5)
    return events


@pytest.fixture
def store(platform: Settings):  # type: ignore[no-untyped-def]
    store = MetadataStore(platform.metadata_url)
    yield store
    store.dispose()


def test_emits_once_per_object_version(platform: Settings, store: MetadataStore, prefect_api: str) -> None:
    bridge, sink = build_bridge(platform, store)
    key = f"datasets/{platform.storage.bucket}/v1/manifest.csv"
    first = bridge.handle(record(key), "sqs")
    second = bridge.handle(record(key), "webhook")  # the same object version, another route
    other = bridge.handle(record(key, etag="e-2"), "sqs")  # a new version of the same key
    assert (first.outcome, first.emitted) == (Outcome.HANDLED, 1)
    assert (second.outcome, second.emitted, second.duplicates) == (Outcome.HANDLED, 0, 1)
    assert other.emitted == 1
    events = prefect_events(prefect_api, f"s3://sluicegate/{key}", want=2)
    assert sorted(event["resource"]["s3.etag"] for event in events) == ["e-1", "e-2"]  # type: ignore[index]
    assert all(event["resource"]["s3.object.name"] == "manifest.csv" for event in events)  # type: ignore[index]
    with store.session() as session:
        rows = session.scalars(select(S3Event).where(S3Event.key == key)).all()
        assert len(rows) == 2 and all(row.emitted_at is not None for row in rows)
    sink.close()


def test_malformed_goes_to_dead_letters_and_the_next_message_still_flows(
    platform: Settings, store: MetadataStore
) -> None:
    bridge, sink = build_bridge(platform, store)
    bad = bridge.handle('{"Records": [{"eventName": "ObjectCreated:Put"}]}', "sqs")
    good = bridge.handle(record(f"datasets/{platform.storage.bucket}/v2/manifest.csv"), "sqs")
    assert bad.outcome is Outcome.MALFORMED and "s3.bucket.name" in (bad.error or "")
    assert good.outcome is Outcome.HANDLED and good.emitted == 1
    with store.session() as session:
        [letter] = session.scalars(select(DeadLetter)).all()
        assert letter.source == "sqs" and "s3.bucket.name" in letter.error and "ObjectCreated" in letter.body
    sink.close()


def test_unreachable_prefect_leaves_the_message_for_redelivery(platform: Settings, store: MetadataStore) -> None:
    sink = PrefectEventSink(f"http://127.0.0.1:{free_port()}/api", "s3.object.created", timeout=2)
    bridge = Bridge(store, sink)
    key = f"datasets/{platform.storage.bucket}/v3/manifest.csv"
    result = bridge.handle(record(key), "sqs")
    assert result.outcome is Outcome.RETRY and "unreachable" in (result.error or "")
    with store.session() as session:
        row = session.scalars(select(S3Event).where(S3Event.key == key)).one()
        assert row.emitted_at is None  # claimed, not emitted: a redelivery emits it

    sqs = storage.sqs_client(platform)
    queue = storage.queue_url(platform, sqs)
    sqs.send_message(QueueUrl=queue, MessageBody=record(key))
    source = SqsSource(platform, bridge)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and source.received < 2:  # the bucket's s3:TestEvent, then ours
        source.poll_once()
    assert source.received == 2
    attributes = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
    assert attributes["Attributes"]["ApproximateNumberOfMessagesNotVisible"] == "1"  # not deleted
    sink.close()


def test_sqs_source_acknowledges_and_sets_aside(platform: Settings, store: MetadataStore, prefect_api: str) -> None:
    bridge, sink = build_bridge(platform, store)
    sqs = storage.sqs_client(platform)
    queue = storage.queue_url(platform, sqs)
    dlq = storage.queue_url(platform, sqs, name=platform.events.dead_letter_queue_name)
    # A real notification from the bucket (manifest keys only), then a broken message.
    s3 = storage.s3_client(platform)
    key = "datasets/pcb/sqs/manifest.csv"
    s3.put_object(Bucket=platform.storage.bucket, Key="datasets/pcb/sqs/images/0.png", Body=b"png")
    s3.put_object(Bucket=platform.storage.bucket, Key=key, Body=b"path,label,split\n")
    sqs.send_message(QueueUrl=queue, MessageBody="{not json")
    source = SqsSource(platform, bridge)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and source.received < 3:  # test event, manifest, broken
        source.poll_once()
    assert source.received == 3
    with store.session() as session:
        keys = session.scalars(select(S3Event.key)).all()
        assert keys == [key]  # the image was filtered by the notification's suffix rule
        assert session.scalar(select(func.count()).select_from(DeadLetter)) == 1
    visible = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    assert visible["ApproximateNumberOfMessages"] == "0" and visible["ApproximateNumberOfMessagesNotVisible"] == "0"
    [dead] = sqs.receive_message(QueueUrl=dlq, MessageAttributeNames=["All"], WaitTimeSeconds=1)["Messages"]
    assert dead["Body"] == "{not json" and "not JSON" in dead["MessageAttributes"]["error"]["StringValue"]
    assert prefect_events(prefect_api, f"s3://{platform.storage.bucket}/{key}")
    sink.close()


def test_webhook_answers_by_outcome(platform: Settings, store: MetadataStore) -> None:
    import threading

    import uvicorn

    bridge, sink = build_bridge(platform, store)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(webhook_app(bridge, "s3cret", []), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    key = f"datasets/{platform.storage.bucket}/hook/manifest.csv"
    assert client.post("/events", content=record(key)).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    ok = client.post("/events", content=record(key), headers=auth)
    assert ok.status_code == 200 and ok.json()["emitted"] == 1
    assert client.post("/events", content=record(key), headers=auth).json()["duplicates"] == 1
    bad = client.post("/events", content="[]", headers=auth)
    assert bad.status_code == 400 and "JSON list" in bad.json()["error"]
    assert client.get("/health").json()["status"] == "ok"
    server.should_exit = True
    thread.join(10)
    sink.close()
