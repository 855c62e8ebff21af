"""Object store access (S3 API) and the provisioning the event path needs (bucket, queues, notification).

Works unchanged against AWS, MinIO and the embedded moto server: only the endpoint and credentials
come from settings.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from sluicegate.errors import StorageError
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_sqs import SQSClient

log = logging.getLogger(__name__)

# The embedded moto endpoint accepts any key; these are the conventional placeholders.
_EMBEDDED_KEY = "testing"


def _client_kwargs(settings: Settings) -> dict[str, Any]:
    storage = settings.storage
    kwargs: dict[str, Any] = {
        "region_name": storage.region,
        # botocore's standard retry mode backs off on throttling and transient network errors.
        "config": Config(
            retries={"mode": "standard", "max_attempts": 5},
            max_pool_connections=max(10, storage.max_concurrency),
            connect_timeout=5,
            read_timeout=60,
        ),
    }
    if storage.endpoint_url is not None or storage.embedded:
        kwargs["endpoint_url"] = storage.url
    if storage.access_key_id is not None and storage.secret_access_key is not None:
        kwargs["aws_access_key_id"] = storage.access_key_id.get_secret_value()
        kwargs["aws_secret_access_key"] = storage.secret_access_key.get_secret_value()
    elif storage.embedded:
        kwargs["aws_access_key_id"] = _EMBEDDED_KEY
        kwargs["aws_secret_access_key"] = _EMBEDDED_KEY
    return kwargs


def s3_client(settings: Settings) -> S3Client:
    return boto3.session.Session().client("s3", **_client_kwargs(settings))


def sqs_client(settings: Settings) -> SQSClient:
    return boto3.session.Session().client("sqs", **_client_kwargs(settings))


def credentials_env(settings: Settings) -> dict[str, str]:
    """Environment for child processes (MLflow server, flow runs) that reach the same object store."""
    kwargs = _client_kwargs(settings)
    env = {"AWS_DEFAULT_REGION": settings.storage.region}
    if "endpoint_url" in kwargs:
        env["MLFLOW_S3_ENDPOINT_URL"] = kwargs["endpoint_url"]
        env["AWS_ENDPOINT_URL_S3"] = kwargs["endpoint_url"]
    if "aws_access_key_id" in kwargs:
        env["AWS_ACCESS_KEY_ID"] = kwargs["aws_access_key_id"]
        env["AWS_SECRET_ACCESS_KEY"] = kwargs["aws_secret_access_key"]
    return env


def queue_url(settings: Settings, sqs: SQSClient | None = None, *, name: str | None = None) -> str:
    events = settings.events
    if name is None and events.queue_url:
        return events.queue_url
    client = sqs or sqs_client(settings)
    queue = name or events.queue_name
    try:
        return client.get_queue_url(QueueName=queue)["QueueUrl"]
    except ClientError as exc:
        raise StorageError(
            f"SQS queue {queue!r} not found at {settings.storage.url}: {exc}; create it with "
            "`sluicegate up` (embedded) or set SLUICEGATE_EVENTS__QUEUE_URL"
        ) from exc


def provision(settings: Settings) -> dict[str, str]:
    """Create the bucket (versioned), the event queue and its dead-letter queue, and the notification.

    Idempotent: every call converges to the same configuration. Returns the queue URLs.

    Raises:
        StorageError: the endpoint refused a request; the message names the resource.
    """
    s3 = s3_client(settings)
    sqs = sqs_client(settings)
    bucket = settings.storage.bucket
    events = settings.events
    try:
        try:
            s3.head_bucket(Bucket=bucket)
        except ClientError:
            s3.create_bucket(Bucket=bucket)
        # Versioning gives every object PUT its own version id, the data version's anchor in lineage.
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        dlq_url = sqs.create_queue(QueueName=events.dead_letter_queue_name)["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        main_url = sqs.create_queue(
            QueueName=events.queue_name,
            Attributes={"VisibilityTimeout": str(events.visibility_timeout)},
        )["QueueUrl"]
        main_arn = sqs.get_queue_attributes(QueueUrl=main_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        # SQS moves a message that keeps failing (the bridge crashing on it) to the DLQ by itself.
        sqs.set_queue_attributes(
            QueueUrl=main_url,
            Attributes={"RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})},
        )
        rules: list[Any] = [{"Name": "prefix", "Value": settings.storage.datasets_prefix}]
        if events.notification_suffix:
            rules.append({"Name": "suffix", "Value": events.notification_suffix})
        s3.put_bucket_notification_configuration(
            Bucket=bucket,
            NotificationConfiguration={
                "QueueConfigurations": [
                    {
                        "Id": "sluicegate-dataset-events",
                        "QueueArn": main_arn,
                        "Events": ["s3:ObjectCreated:*"],
                        "Filter": {"Key": {"FilterRules": rules}},
                    }
                ]
            },
        )
    except (ClientError, BotoCoreError) as exc:
        raise StorageError(f"provisioning bucket {bucket!r} at {settings.storage.url} failed: {exc}") from exc
    log.info("provisioned bucket %s, queue %s, dead-letter queue %s", bucket, main_url, dlq_url)
    return {"queue_url": main_url, "dead_letter_queue_url": dlq_url}
