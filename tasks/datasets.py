"""The dataset contract: ``datasets/<name>/<version>/`` holding images and ``manifest.csv``.

Resolving a dataset version pins it: the manifest's sha256 is the data version, and every object the
manifest lists is resolved to its S3 version id and ETag, so the exact bytes can be fetched later.
"""

from __future__ import annotations

import csv
import io
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluicegate import ids
from sluicegate.errors import DatasetError, StorageError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MANIFEST = "manifest.csv"
REQUIRED_COLUMNS = ("path", "label", "split")


@dataclass(frozen=True)
class DatasetRef:
    """Where a dataset version lives, from its manifest key."""

    name: str
    label: str
    prefix: str

    @property
    def manifest_key(self) -> str:
        return self.prefix + MANIFEST


@dataclass(frozen=True)
class ResolvedDataset:
    """A dataset version pinned to exact object versions."""

    name: str
    label: str
    bucket: str
    prefix: str
    manifest_key: str
    manifest_etag: str
    manifest_version_id: str | None
    data_version: str
    objects: dict[str, dict[str, Any]] = field(hash=False)
    rows: int = 0

    @property
    def data7(self) -> str:
        return self.data_version[: ids.SHORT]

    @property
    def objects_digest(self) -> str:
        return ids.object_versions_digest(self.objects)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.manifest_key}"


def parse_dataset_key(key: str, datasets_prefix: str = "datasets/") -> DatasetRef:
    """Split ``datasets/<name>/<version>/manifest.csv`` into its parts.

    Raises:
        DatasetError: the key does not follow the layout; the message shows the expected one.
    """
    expected = f"{datasets_prefix}<name>/<version>/{MANIFEST}"
    if not key.startswith(datasets_prefix) or not key.endswith("/" + MANIFEST):
        raise DatasetError(f"key {key!r} is not a dataset manifest; expected {expected!r}")
    parts = key[len(datasets_prefix) :].split("/")
    if len(parts) != 3 or not all(parts[:2]):
        raise DatasetError(f"key {key!r} is not a dataset manifest; expected {expected!r}")
    name, label, _ = parts
    return DatasetRef(name=name, label=label, prefix=f"{datasets_prefix}{name}/{label}/")


def manifest_paths(manifest: bytes) -> list[str]:
    """The object paths a manifest lists, relative to its dataset prefix.

    Only what resolution needs is checked here (columns, safe relative paths); label and split
    quality is the data gate's business.

    Raises:
        DatasetError: not UTF-8 CSV, a required column missing, or an unsafe path.
    """
    try:
        text = manifest.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{MANIFEST} is not UTF-8 text: {exc}") from exc
    reader = csv.DictReader(io.StringIO(text))
    columns = [column.strip() for column in reader.fieldnames or []]
    missing = [column for column in REQUIRED_COLUMNS if column not in columns]
    if missing:
        raise DatasetError(
            f"{MANIFEST} lacks column(s) {', '.join(missing)}; its header must be "
            f"'path,label,split' (optional 'sha256'), found {','.join(columns) or 'nothing'}"
        )
    paths: list[str] = []
    for line, row in enumerate(reader, start=2):
        path = (row.get("path") or "").strip()
        if not path:
            raise DatasetError(f"{MANIFEST} line {line}: column 'path' is empty; every row names an image")
        normal = posixpath.normpath(path)
        if normal.startswith(("/", "..")) or normal != path:
            raise DatasetError(
                f"{MANIFEST} line {line}: path {path!r} must be relative to the dataset folder "
                "without '..' or '.' parts (e.g. images/0001.png)"
            )
        paths.append(path)
    return paths


def read_manifest(s3: S3Client, bucket: str, key: str, version_id: str | None = None) -> tuple[bytes, str, str | None]:
    """Fetch a manifest (the given version when known); returns (bytes, etag, version id)."""
    from botocore.exceptions import BotoCoreError, ClientError

    args: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version_id:
        args["VersionId"] = version_id
    try:
        response = s3.get_object(**args)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "NoSuchVersion", "404"):
            raise DatasetError(
                f"manifest s3://{bucket}/{key} (version {version_id or 'latest'}) does not exist"
            ) from exc
        raise StorageError(f"reading s3://{bucket}/{key} failed: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"reading s3://{bucket}/{key} failed: {exc}") from exc
    body = response["Body"].read()
    version = response.get("VersionId")
    return body, response["ETag"].strip('"'), version if version and version != "null" else None


def resolve_objects(
    s3: S3Client, bucket: str, prefix: str, paths: Sequence[str], concurrency: int = 16
) -> dict[str, dict[str, Any]]:
    """HEAD every listed object (in parallel); each maps to its version id, ETag and size.

    Raises:
        DatasetError: listed objects are missing (the first few are named).
    """

    from botocore.exceptions import ClientError

    def head(path: str) -> tuple[str, dict[str, Any] | None]:
        try:
            meta = s3.head_object(Bucket=bucket, Key=prefix + path)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return path, None
            raise StorageError(f"HEAD s3://{bucket}/{prefix}{path} failed: {exc}") from exc
        version = meta.get("VersionId")
        return path, {
            "version_id": version if version and version != "null" else None,
            "etag": meta["ETag"].strip('"'),
            "size": meta["ContentLength"],
        }

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = dict(pool.map(head, sorted(set(paths))))
    missing = [path for path, meta in results.items() if meta is None]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DatasetError(
            f"{MANIFEST} at s3://{bucket}/{prefix} lists {len(missing)} object(s) that do not exist: {shown}; "
            "upload the images before the manifest"
        )
    return {path: meta for path, meta in results.items() if meta is not None}


def resolve_dataset_version(
    s3: S3Client,
    bucket: str,
    key: str,
    version_id: str | None = None,
    *,
    datasets_prefix: str = "datasets/",
    concurrency: int = 16,
) -> tuple[ResolvedDataset, bytes]:
    """Pin the dataset version announced by a manifest; returns it and the manifest's bytes."""
    ref = parse_dataset_key(key, datasets_prefix)
    manifest, etag, manifest_version = read_manifest(s3, bucket, key, version_id)
    paths = manifest_paths(manifest)
    objects = resolve_objects(s3, bucket, ref.prefix, paths, concurrency)
    resolved = ResolvedDataset(
        name=ref.name,
        label=ref.label,
        bucket=bucket,
        prefix=ref.prefix,
        manifest_key=key,
        manifest_etag=etag,
        manifest_version_id=manifest_version,
        data_version=ids.data_version(manifest),
        objects=objects,
        rows=len(paths),
    )
    return resolved, manifest


def newest_manifests(s3: S3Client, bucket: str, datasets_prefix: str = "datasets/") -> dict[str, tuple[Any, str]]:
    """The most recently written manifest of each dataset name in the bucket: name -> (LastModified, key)."""
    newest: dict[str, tuple[Any, str]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=datasets_prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            try:
                name = parse_dataset_key(key, datasets_prefix).name
            except DatasetError:
                continue
            # LastModified has one-second resolution; on a tie the later key (labels are usually
            # dates) wins, so the choice is deterministic.
            if name not in newest or (obj["LastModified"], key) > newest[name]:
                newest[name] = (obj["LastModified"], key)
    return newest


def manifest_version_id(s3: S3Client, bucket: str, key: str) -> str | None:
    """The current S3 version id of a manifest (None on an unversioned bucket)."""
    version = s3.head_object(Bucket=bucket, Key=key).get("VersionId")
    return version if version and version != "null" else None


def newest_manifest(s3: S3Client, bucket: str, datasets_prefix: str = "datasets/") -> tuple[str, str | None] | None:
    """The most recently written dataset manifest in the bucket: (key, version id), or None."""
    found = newest_manifests(s3, bucket, datasets_prefix)
    if not found:
        return None
    _, key = max(found.values())
    return key, manifest_version_id(s3, bucket, key)
