"""Uploading a dataset version: every file in parallel, the manifest last (its event announces the rest)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sluicegate import ids, storage
from sluicegate.errors import DatasetError
from sluicegate.settings import Settings

MANIFEST = "manifest.csv"


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
