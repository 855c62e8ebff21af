"""Uploading a dataset version: every file in parallel, the manifest last (its event announces the rest)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sluicegate import ids, storage
from sluicegate.errors import DatasetError
from sluicegate.settings import Settings
from tasks.datasets import MANIFEST


@dataclass(frozen=True)
class Pushed:
    bucket: str
    manifest_key: str
    data_version: str
    files: int


def push_directory(
    settings: Settings,
    directory: Path,
    name: str,
    label: str,
    on_file: Callable[[str], None] | None = None,
) -> Pushed:
    """Upload ``directory`` as ``datasets/<name>/<label>/``, manifest last.

    Raises:
        DatasetError: the directory has no manifest.csv, or the name or label is unusable in a key.
    """
    for field, value in (("name", name), ("label", label)):
        if not value or "/" in value or value in (".", ".."):
            raise DatasetError(f"dataset {field} {value!r} must be a non-empty key segment without '/'")
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise DatasetError(f"{directory} has no {MANIFEST}; a dataset version is described by one")
    files = sorted(path for path in directory.rglob("*") if path.is_file() and path != manifest)
    prefix = f"{settings.storage.datasets_prefix}{name}/{label}/"
    s3 = storage.s3_client(settings)
    bucket = settings.storage.bucket

    def put(path: Path) -> str:
        relative = path.relative_to(directory).as_posix()
        s3.upload_file(str(path), bucket, prefix + relative)
        if on_file is not None:
            on_file(relative)
        return relative

    with ThreadPoolExecutor(max_workers=settings.storage.max_concurrency) as pool:
        list(pool.map(put, files))
    put(manifest)
    return Pushed(bucket, prefix + MANIFEST, ids.data_version(manifest.read_bytes()), len(files) + 1)


@dataclass(frozen=True)
class ListedVersion:
    name: str
    label: str
    manifest_key: str
    last_modified: str
    size: int


def list_versions(settings: Settings, name: str | None = None) -> list[ListedVersion]:
    """Dataset versions in the bucket (one per manifest), oldest first."""
    s3 = storage.s3_client(settings)
    prefix = settings.storage.datasets_prefix + (f"{name}/" if name else "")
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=settings.storage.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            parts = obj["Key"][len(settings.storage.datasets_prefix) :].split("/")
            if len(parts) == 3 and parts[2] == MANIFEST:
                found.append(
                    ListedVersion(parts[0], parts[1], obj["Key"], obj["LastModified"].isoformat(), obj["Size"])
                )
    return sorted(found, key=lambda v: (v.last_modified, v.manifest_key))


def pull_version(
    settings: Settings,
    name: str,
    label: str,
    directory: Path,
    on_file: Callable[[str], None] | None = None,
) -> Pushed:
    """Download ``datasets/<name>/<label>/`` (the manifest and every file it lists) into ``directory``.

    Raises:
        DatasetError: no such version, or the manifest lists files that are missing.
    """
    from tasks.dataset_source import S3Source, map_objects
    from tasks.datasets import manifest_paths

    prefix = f"{settings.storage.datasets_prefix}{name}/{label}/"
    source = S3Source(storage.s3_client(settings), settings.storage.bucket, prefix)
    manifest = source.manifest()
    paths = manifest_paths(manifest)

    def write(path: str, data: bytes) -> int:
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if on_file is not None:
            on_file(path)
        return len(data)

    missing = [
        path
        for path, outcome in map_objects(source, paths, write, settings.storage.max_concurrency)
        if isinstance(outcome, DatasetError)
    ]
    if missing:
        raise DatasetError(
            f"{len(missing)} listed file(s) missing under s3://{settings.storage.bucket}/{prefix}: "
            + ", ".join(missing[:5])
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_bytes(manifest)
    return Pushed(settings.storage.bucket, prefix + MANIFEST, ids.data_version(manifest), len(paths) + 1)
