"""Where a dataset version's bytes come from: a local folder or a pinned S3 prefix, one interface.

Gates and training read through a ``DatasetSource`` so they run the same on a folder a user is about
to upload (``sluicegate check data DIR``) and on the version the pipeline pinned in S3.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sluicegate.errors import DatasetError, StorageError
from tasks.datasets import MANIFEST, ResolvedDataset

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

T = TypeVar("T")


class DatasetSource(Protocol):
    """Read access to one dataset version."""

    @property
    def uri(self) -> str: ...

    def manifest(self) -> bytes: ...

    def read(self, path: str) -> bytes:
        """The bytes of one listed object, by its manifest path.

        Raises:
            DatasetError: the object does not exist.
        """
        ...


class LocalSource:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def uri(self) -> str:
        return str(self.directory)

    def manifest(self) -> bytes:
        path = self.directory / MANIFEST
        if not path.is_file():
            raise DatasetError(f"{self.directory} has no {MANIFEST}; a dataset version is described by one")
        return path.read_bytes()

    def read(self, path: str) -> bytes:
        try:
            return (self.directory / path).read_bytes()
        except FileNotFoundError as exc:
            raise DatasetError(f"{MANIFEST} lists {path!r}, which is not in {self.directory}") from exc


class S3Source:
    """A dataset version in S3; with ``versions`` every read is pinned to the resolved object version."""

    def __init__(
        self,
        s3: S3Client,
        bucket: str,
        prefix: str,
        *,
        manifest_version: str | None = None,
        versions: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._manifest_version = manifest_version
        self._versions = versions or {}

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _get(self, key: str, version: str | None) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if version:
            args["VersionId"] = version
        try:
            return self._s3.get_object(**args)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchVersion", "404"):
                raise DatasetError(f"s3://{self.bucket}/{key} (version {version or 'latest'}) does not exist") from exc
            raise StorageError(f"reading s3://{self.bucket}/{key} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"reading s3://{self.bucket}/{key} failed: {exc}") from exc

    def manifest(self) -> bytes:
        return self._get(self.prefix + MANIFEST, self._manifest_version)

    def read(self, path: str) -> bytes:
        return self._get(self.prefix + path, (self._versions.get(path) or {}).get("version_id"))


def pinned_source(s3: S3Client, dataset: ResolvedDataset) -> S3Source:
    """What every pipeline stage reads a resolved version through: each read pinned to the object version
    the resolve step recorded, so a file overwritten mid-run cannot change what a later stage sees."""
    return S3Source(
        s3, dataset.bucket, dataset.prefix, manifest_version=dataset.manifest_version_id, versions=dataset.objects
    )


def open_location(location: str, s3: Callable[[], S3Client]) -> DatasetSource:
    """A dataset a user names on the command line: a folder, or ``s3://bucket/prefix/`` (latest versions).

    Args:
        location: the folder or URI.
        s3: makes the S3 client, called only for an ``s3://`` location.

    Raises:
        DatasetError: neither an existing folder nor an ``s3://`` URI.
    """
    if location.startswith("s3://"):
        bucket, prefix = parse_s3_uri(location)
        return S3Source(s3(), bucket, prefix)
    path = Path(location)
    if not path.is_dir():
        raise DatasetError(
            f"LOCATION: {location} is neither a folder nor an s3://bucket/prefix/ URI; name a dataset folder "
            "(with manifest.csv) or a pushed version's prefix"
        )
    return LocalSource(path)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix/`` -> (bucket, prefix)."""
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise DatasetError(f"{uri!r} is not an s3://bucket/prefix/ URI")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix


def map_objects(
    source: DatasetSource, paths: Sequence[str], fn: Callable[[str, bytes], T], concurrency: int
) -> Iterator[tuple[str, T | DatasetError]]:
    """Read each object and apply ``fn`` to its bytes in a worker thread, yielding results in order.

    At most ``concurrency`` objects are in flight, so memory stays bounded whatever the dataset's size
    (the bytes are dropped once ``fn`` has reduced them). A missing object is yielded as its
    ``DatasetError``: to a gate it is a finding, not a crash.
    """

    def work(path: str) -> T | DatasetError:
        try:
            return fn(path, source.read(path))
        except DatasetError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        window: deque[tuple[str, Future[T | DatasetError]]] = deque()
        for path in paths:
            if len(window) >= concurrency:
                done_path, future = window.popleft()
                yield done_path, future.result()
            window.append((path, pool.submit(work, path)))
        while window:
            done_path, future = window.popleft()
            yield done_path, future.result()
