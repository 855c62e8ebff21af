"""S3 object-created notifications, normalised.

Three senders, one record type: S3 -> SQS (optionally wrapped in SNS), MinIO's webhook (S3 records
plus ``EventName``/``Key``), and EventBridge (``detail-type: Object Created``). Pure parsing, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import unquote_plus

from sluicegate.errors import EventError

# Namespace of the deterministic Prefect event ids: a redelivered object version maps to the same id,
# which Prefect's trigger service also recognises as already seen.
EVENT_NAMESPACE = uuid.UUID("6f1d7a52-3c1e-4e55-9a4b-7f1f0b5c2d11")


@dataclass(frozen=True)
class S3ObjectEvent:
    """One object version that was created."""

    bucket: str
    key: str
    etag: str
    size: int | None
    version_id: str | None
    sequencer: str | None
    event_time: datetime | None
    event_name: str

    @property
    def dedupe_key(self) -> str:
        """What identifies an object version across every sender (moto sends no versionId/sequencer)."""
        identity = json.dumps([self.bucket, self.key, self.etag, self.version_id or "", self.sequencer or ""])
        return hashlib.sha256(identity.encode()).hexdigest()

    @property
    def event_id(self) -> uuid.UUID:
        return uuid.uuid5(EVENT_NAMESPACE, self.dedupe_key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def resource(self) -> dict[str, str]:
        """Prefect resource labels (all strings, as Prefect requires)."""
        labels = {
            "prefect.resource.id": self.uri,
            "prefect.resource.name": self.key.rsplit("/", 1)[-1],
            "s3.bucket": self.bucket,
            "s3.key": self.key,
            # Prefect's matcher only knows prefix wildcards; the file name lets a trigger select
            # "keys ending in /manifest.csv" exactly.
            "s3.object.name": self.key.rsplit("/", 1)[-1],
            "s3.etag": self.etag,
            "s3.version-id": self.version_id or "",
            "s3.sequencer": self.sequencer or "",
        }
        if self.size is not None:
            labels["s3.size"] = str(self.size)
        return labels


@dataclass(frozen=True)
class ParsedMessage:
    """What one message carried: object-created records, and what was deliberately not forwarded."""

    records: tuple[S3ObjectEvent, ...]
    ignored: tuple[str, ...] = ()


def _field(container: Any, path: str, where: str) -> Any:
    value = container
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise EventError(f"{where}: missing field {path!r}; expected an S3 event notification record")
        value = value[part]
    return value


def _time(value: Any, where: str) -> datetime | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise EventError(f"{where}: eventTime {value!r} is not an ISO-8601 string")
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise EventError(f"{where}: eventTime {value!r} is not an ISO-8601 timestamp") from exc


def _size(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise EventError(f"{where}: object size {value!r} is not an integer")
    try:
        return int(value)
    except ValueError as exc:
        raise EventError(f"{where}: object size {value!r} is not an integer") from exc


def _str(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise EventError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value and value != "null" else None


def _s3_record(record: Any, where: str) -> S3ObjectEvent | str:
    name = _str(_field(record, "eventName", where), "eventName", where)
    if "ObjectCreated" not in name:
        return f"{where}: {name} is not an object-created event"
    bucket = _str(_field(record, "s3.bucket.name", where), "s3.bucket.name", where)
    obj = _field(record, "s3.object", where)
    key = unquote_plus(_str(_field(obj, "key", where), "s3.object.key", where))
    etag = _str(obj.get("eTag") or obj.get("etag"), "s3.object.eTag", where).strip('"')
    return S3ObjectEvent(
        bucket=bucket,
        key=key,
        etag=etag,
        size=_size(obj.get("size"), where),
        version_id=_optional_str(obj.get("versionId")),
        sequencer=_optional_str(obj.get("sequencer")),
        event_time=_time(record.get("eventTime"), where),
        event_name=name.removeprefix("s3:"),
    )


def _eventbridge(message: dict[str, Any]) -> S3ObjectEvent | str:
    where = "EventBridge event"
    kind = message.get("detail-type")
    if kind != "Object Created":
        return f"{where}: {kind} is not an object-created event"
    detail = _field(message, "detail", where)
    obj = _field(detail, "object", where)
    return S3ObjectEvent(
        bucket=_str(_field(detail, "bucket.name", where), "detail.bucket.name", where),
        key=unquote_plus(_str(_field(obj, "key", where), "detail.object.key", where)),
        etag=_str(obj.get("etag"), "detail.object.etag", where).strip('"'),
        size=_size(obj.get("size"), where),
        version_id=_optional_str(obj.get("version-id")),
        sequencer=_optional_str(obj.get("sequencer")),
        event_time=_time(message.get("time"), where),
        event_name="ObjectCreated:" + str(detail.get("reason", "PutObject")),
    )


def parse_message(body: str | bytes) -> ParsedMessage:
    """Parse one notification message body.

    Raises:
        EventError: the body is not JSON or not an S3 notification; the message names the field.
    """
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise EventError(f"message body is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise EventError(f"message body is a JSON {type(message).__name__}, expected an object")
    # SNS fan-out wraps the S3 notification as a JSON string.
    if message.get("Type") == "Notification" and isinstance(message.get("Message"), str):
        return parse_message(message["Message"])
    # S3 sends one test event when a notification is configured; it carries no object.
    if message.get("Event") == "s3:TestEvent":
        return ParsedMessage(records=(), ignored=("s3:TestEvent",))
    if message.get("source") == "aws.s3" and "detail" in message:
        result = _eventbridge(message)
        return ParsedMessage(records=(result,)) if isinstance(result, S3ObjectEvent) else ParsedMessage((), (result,))
    records = message.get("Records")
    if not isinstance(records, list) or not records:
        raise EventError(
            "message has no 'Records' list; expected an S3 event notification, "
            "an SNS notification wrapping one, or an EventBridge 'Object Created' event"
        )
    parsed: list[S3ObjectEvent] = []
    ignored: list[str] = []
    for index, record in enumerate(records):
        result = _s3_record(record, f"Records[{index}]")
        if isinstance(result, S3ObjectEvent):
            parsed.append(result)
        else:
            ignored.append(result)
    return ParsedMessage(records=tuple(parsed), ignored=tuple(ignored))
