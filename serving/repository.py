"""Where the server's model versions come from: a local directory, an S3 prefix, or an MLflow registered
model (``models:/<name>@<alias>`` or ``models:/<name>/<version>``).

Remote sources are first copied into a local cache in the repository layout
(``<root>/<model>/<version>/``); then every version folder is verified (``SHA256SUMS``, no pickles,
config matching its folder) before anything loads it. A version that fails verification is reported with
its reason and skipped: one damaged version never stops the others from serving.

MLflow is reached through its REST API (``serving/mlflow_rest.py``), not the ``mlflow`` package.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, NamedTuple

from serving.errors import RepositoryError
from serving.mlflow_rest import MlflowRest
from serving.model_format import CONFIG, SUMS, ModelConfig, read_config, verify_version
from serving.redact import mask_text, mask_url

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
CACHE_LOCK = ".lock"  # in cache_dir; never pruned (a new file would be a second, unshared lock)
MODELS_SCHEME = "models:/"


@dataclass(frozen=True)
class LocalVersion:
    """A verified version folder, ready to load."""

    model: str
    version: str
    path: Path
    config: ModelConfig


class RejectedVersion(NamedTuple):
    """A version folder that failed verification; unpacks as ``(where, reason)``."""

    where: str  # "<model>/<version>", relative to the repository root
    reason: str


class ModelRepository:
    """The model versions of one source, materialised as a local repository root.

    Args:
        source: a directory, ``s3://bucket/prefix`` or ``models:/<name>@<alias>`` /
            ``models:/<name>/<version>``.
        cache_dir: where remote sources are copied. It belongs to this repository: for an S3 source,
            files there that the prefix no longer holds are removed on the next ``materialize()``.
        mlflow_tracking_uri: the MLflow server for ``models:/`` sources.
        s3_endpoint_url: an S3-compatible endpoint (MinIO, moto); credentials come from boto3's usual
            chain (environment, shared files, instance role).
    """

    def __init__(
        self,
        source: str,
        *,
        cache_dir: Path,
        mlflow_tracking_uri: str | None = None,
        s3_endpoint_url: str | None = None,
    ) -> None:
        self.source = source
        self.cache_dir = Path(cache_dir)
        self.mlflow_tracking_uri = mlflow_tracking_uri
        self.s3_endpoint_url = s3_endpoint_url
        self.rejected: list[RejectedVersion] = []  # from the last versions() call
        self._root: Path | None = None
        # A models:/ source names one version; the cache may still hold ones an alias pointed at before.
        self._only: tuple[str, str] | None = None

    def materialize(self) -> Path:
        """Bring the source's files to a local repository root and return it.

        Raises:
            RepositoryError: the source is missing, empty, unreachable or names nothing; the message
                names the source and the fix.
        """
        if self.source.startswith(S3_SCHEME):
            with _cache_lock(self.cache_dir):
                root = self._from_s3()
        elif self.source.startswith(MODELS_SCHEME):
            with _cache_lock(self.cache_dir):
                root = self._from_mlflow()
        else:
            root = self._from_directory()
        self._root = root
        return root

    def versions(self) -> list[LocalVersion]:
        """Every version under the materialised root that verifies (materialising first if needed).

        Versions that fail verification are left out and listed in ``self.rejected`` with their reason.
        """
        root = self._root if self._root is not None else self.materialize()
        loaded: list[LocalVersion] = []
        rejected: list[RejectedVersion] = []
        for folder in self._version_folders(root):
            where = f"{folder.parent.name}/{folder.name}"
            try:
                config = verify_version(folder)
            except (RepositoryError, OSError, ValueError) as exc:
                # OSError/ValueError: unreadable or undecodable files; reported like any other damage.
                reason = mask_text(str(exc))
                log.error("rejected model version %s from %s: %s", where, mask_url(self.source), reason)
                rejected.append(RejectedVersion(where, reason))
                continue
            loaded.append(LocalVersion(config.name, config.version, folder, config))
        self.rejected = rejected
        return loaded

    def _version_folders(self, root: Path) -> Iterator[Path]:
        if self._only is not None:
            yield root.joinpath(*self._only)
            return
        # Dot-names are staging folders (write_version's .partial, our .download) or tooling, never versions.
        for model in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            yield from sorted(p for p in model.iterdir() if p.is_dir() and not p.name.startswith("."))

    # -- local ------------------------------------------------------------------------------------

    def _from_directory(self) -> Path:
        root = Path(self.source.removeprefix("file://")).expanduser()
        if not root.is_dir():
            raise RepositoryError(
                f"model repository {self.source!r} is not a directory: create it with <model>/<version>/ folders, "
                "or pass an s3://bucket/prefix or models:/<name>@<alias> source"
            )
        return root

    # -- S3 ---------------------------------------------------------------------------------------

    def _from_s3(self) -> Path:
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, prefix = self.source.removeprefix(S3_SCHEME).partition("/")
        if not bucket:
            raise RepositoryError(f"model repository {self.source!r} names no bucket: use s3://bucket/prefix")
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        root = self.cache_dir
        try:
            client = self._s3_client()
            objects = dict(_list_objects(client, bucket, prefix))
            if not objects:
                raise RepositoryError(
                    f"model repository {self.source!r} holds no objects: upload <model>/<version>/ folders "
                    "under that prefix, or fix the prefix"
                )
            for relative, (size, modified) in sorted(objects.items()):
                _download_object(client, bucket, prefix + relative, root / relative, size, modified)
        except (BotoCoreError, ClientError) as exc:
            # botocore's messages name the endpoint and, for a pre-signed URL, its signature.
            endpoint = mask_url(self.s3_endpoint_url) if self.s3_endpoint_url else "AWS default"
            raise RepositoryError(
                f"model repository {self.source!r} could not be read from S3 "
                f"(endpoint {endpoint}): {mask_text(str(exc))}; check the bucket, the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile) and the endpoint setting"
            ) from exc
        _prune(root, set(objects))
        return root

    def _s3_client(self) -> S3Client:
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_endpoint_url)

    # -- MLflow -----------------------------------------------------------------------------------

    def _from_mlflow(self) -> Path:
        if not self.mlflow_tracking_uri:
            raise RepositoryError(
                f"model repository {self.source!r} needs an MLflow tracking server: set mlflow_tracking_uri"
            )
        registry = MlflowRest(self.mlflow_tracking_uri.rstrip("/"), self.source)
        try:
            version = registry.model_version(self.source.removeprefix(MODELS_SCHEME))
            run_id = str(version.get("run_id") or "")
            if not run_id:
                raise RepositoryError(
                    f"{self.source}: registry version {version.get('version')} has no run_id, so its files "
                    "cannot be listed; register versions from a run (tasks.registry.register_version)"
                )
            artifact_path = registry.artifact_path(run_id, str(version.get("source") or ""))
            target = self._download_run_folder(registry, run_id, artifact_path)
        finally:
            registry.close()
        self._only = (target.parent.name, target.name)
        return self.cache_dir

    def _download_run_folder(self, registry: MlflowRest, run_id: str, artifact_path: str) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        staging = self.cache_dir / f".download-{uuid.uuid4().hex}"
        try:
            files = registry.list_files(run_id, artifact_path)
            if not files:
                raise RepositoryError(
                    f"{self.source}: run {run_id} has no files under {artifact_path!r}: "
                    "log the version folder there (tasks.registry.register_version) or register another version"
                )
            remote = {str(_safe_relative(p.removeprefix(artifact_path).lstrip("/"), self.source)): p for p in files}
            if CONFIG not in remote:
                raise RepositoryError(
                    f"{self.source}: {artifact_path!r} of run {run_id} holds no {CONFIG}, so it is not a model "
                    "version folder: register a folder written by write_version"
                )
            # The two small files first: they say where the version goes and whether the cache has it.
            small = [name for name in (CONFIG, SUMS) if name in remote]
            for name in small:
                registry.download(run_id, remote[name], staging / name)
            config = read_config(staging)
            target = self.cache_dir / config.name / config.version
            if _cached_copy_is_whole(target, staging):
                return target
            for name, path in sorted(remote.items()):
                if name not in small:
                    registry.download(run_id, path, staging / name)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():  # a damaged or partial cached copy: replaced, so it heals
                shutil.rmtree(target)
            staging.rename(target)
            return target
        finally:
            if staging.exists():
                shutil.rmtree(staging)


@contextlib.contextmanager
def _cache_lock(cache_dir: Path) -> Iterator[None]:
    """One copy into ``cache_dir`` at a time: the worker processes of one server share it, and one's
    pruning would delete another's files mid-download."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / CACHE_LOCK).open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if this process dies holding it
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached_copy_is_whole(target: Path, staging: Path) -> bool:
    """Whether ``target`` already holds the version whose sums are in ``staging`` (no need to download)."""
    if not (target / SUMS).is_file() or not (staging / SUMS).is_file():
        return False
    if (target / SUMS).read_bytes() != (staging / SUMS).read_bytes():
        return False
    try:
        verify_version(target)
    except (RepositoryError, OSError, ValueError):
        return False
    return True


def _safe_relative(relative: str, source: str) -> PurePosixPath:
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts:
        raise RepositoryError(f"{source}: refusing the remote path {relative!r}: it would land outside the cache")
    return path


def _list_objects(client: S3Client, bucket: str, prefix: str) -> Iterator[tuple[str, tuple[int, datetime]]]:
    """``(key relative to prefix, (size, last modified))`` of every object under ``prefix``."""
    source = f"s3://{bucket}/{prefix}"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            relative = item["Key"].removeprefix(prefix)
            if relative and not relative.endswith("/"):  # "folder/" keys are console-made placeholders
                yield str(_safe_relative(relative, source)), (item["Size"], item["LastModified"])


def _download_object(client: S3Client, bucket: str, key: str, target: Path, size: int, modified: datetime) -> None:
    """Download unless the cached copy has the same size and modification time (like ``aws s3 sync``)."""
    stamp = round(modified.timestamp() * 1e9)  # in ns, so the comparison below is exact
    if target.is_file() and (target.stat().st_size, target.stat().st_mtime_ns) == (size, stamp):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a side file first: a crash mid-download must not leave a truncated file under the real name.
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        client.download_file(bucket, key, str(partial))
        os.utime(partial, ns=(stamp, stamp))
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def _prune(root: Path, keep: set[str]) -> None:
    """Remove cached files the source no longer holds, so a version deleted upstream is not served."""
    for path in sorted(root.rglob("*"), reverse=True):  # children before their folders
        relative = path.relative_to(root).as_posix()
        if relative == CACHE_LOCK:
            continue
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif relative not in keep:
            path.unlink()
