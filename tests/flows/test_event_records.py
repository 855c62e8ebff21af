import json
from datetime import UTC, datetime

import pytest

from flows.events.records import parse_message
from sluicegate.errors import EventError


def s3_record(key: str = "datasets/pcb/v1/manifest.csv", **obj: object) -> dict[str, object]:
    return {
        "eventVersion": "2.1",
        "eventSource": "aws:s3",
        "eventTime": "2026-11-29T10:00:00.000Z",
        "eventName": "ObjectCreated:Put",
        "s3": {"bucket": {"name": "sluicegate"}, "object": {"key": key, "size": 42, "eTag": "abc123", **obj}},
    }


def test_moto_shape_without_version_or_sequencer_decodes_the_key() -> None:
    body = json.dumps({"Records": [s3_record("datasets/pcb/2026-11-29+run%2F1/manifest.csv")]})
    [record] = parse_message(body).records
    assert record.key == "datasets/pcb/2026-11-29 run/1/manifest.csv"
    assert record.version_id is None and record.sequencer is None
    assert record.event_time == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert record.resource()["s3.object.name"] == "manifest.csv"
    assert record.resource()["prefect.resource.id"] == "s3://sluicegate/datasets/pcb/2026-11-29 run/1/manifest.csv"


def test_real_s3_fields_become_labels_and_distinguish_versions() -> None:
    a = parse_message(json.dumps({"Records": [s3_record(versionId="v1", sequencer="0A")]})).records[0]
    b = parse_message(json.dumps({"Records": [s3_record(versionId="v2", sequencer="0B")]})).records[0]
    again = parse_message(json.dumps({"Records": [s3_record(versionId="v1", sequencer="0A")]})).records[0]
    assert a.resource()["s3.version-id"] == "v1" and a.resource()["s3.sequencer"] == "0A"
    assert a.dedupe_key != b.dedupe_key and a.event_id != b.event_id
    assert a.dedupe_key == again.dedupe_key and a.event_id == again.event_id


def test_minio_webhook_and_sns_wrapping() -> None:
    minio = {
        "EventName": "s3:ObjectCreated:Put",
        "Key": "sluicegate/datasets/pcb/v1/manifest.csv",
        "Records": [s3_record(eTag='"quoted"')],
    }
    [record] = parse_message(json.dumps(minio)).records
    assert record.etag == "quoted"
    sns = {"Type": "Notification", "Message": json.dumps({"Records": [s3_record()]})}
    assert parse_message(json.dumps(sns)).records[0].key == "datasets/pcb/v1/manifest.csv"


def test_eventbridge_object_created() -> None:
    event = {
        "version": "0",
        "detail-type": "Object Created",
        "source": "aws.s3",
        "time": "2026-11-29T10:00:00Z",
        "detail": {
            "bucket": {"name": "sluicegate"},
            "object": {
                "key": "datasets/pcb/v1/manifest.csv",
                "size": 7,
                "etag": "e1",
                "version-id": "v9",
                "sequencer": "00ff",
            },
            "reason": "PutObject",
        },
    }
    [record] = parse_message(json.dumps(event)).records
    assert (record.bucket, record.version_id, record.sequencer, record.size) == ("sluicegate", "v9", "00ff", 7)


def test_test_event_and_removals_are_ignored_not_errors() -> None:
    test_event = {"Service": "Amazon S3", "Event": "s3:TestEvent", "Bucket": "sluicegate"}
    assert parse_message(json.dumps(test_event)).records == ()
    removed = {**s3_record(), "eventName": "ObjectRemoved:Delete"}
    parsed = parse_message(json.dumps({"Records": [removed, s3_record()]}))
    assert len(parsed.records) == 1 and "ObjectRemoved" in parsed.ignored[0]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON list"),
        ('{"hello": 1}', "no 'Records' list"),
        (
            json.dumps({"Records": [{"eventName": "ObjectCreated:Put"}]}),
            r"Records\[0\]: missing field 's3.bucket.name'",
        ),
        (json.dumps({"Records": [s3_record(size="big")]}), "size 'big' is not an integer"),
        (json.dumps({"Records": [{**s3_record(), "eventTime": "yesterday"}]}), "eventTime 'yesterday'"),
        (json.dumps({"Records": [s3_record(eTag="")]}), "'s3.object.eTag' must be a non-empty string"),
    ],
)
def test_malformed_messages_name_the_field(body: str, match: str) -> None:
    with pytest.raises(EventError, match=match):
        parse_message(body)
