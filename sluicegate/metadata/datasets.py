"""Repository functions for datasets and their versions (the ``datasets`` and ``dataset_versions`` tables).

A dataset version is a content hash of its manifest, so its first record stands: recording it again
returns the existing row unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluicegate.metadata.models import Dataset, DatasetVersion, utcnow
from sluicegate.metadata.rows import HEX, check_hex, insert_ignore

MIN_PREFIX = 7


def get_or_create_dataset(session: Session, name: str) -> Dataset:
    """Return the dataset called ``name``, creating it if absent.

    Args:
        session: An open session.
        name: The dataset's name (the folder under the datasets prefix, e.g. ``pcb``).

    Returns:
        The one row for ``name``; two processes creating it at once still end with one row.

    Raises:
        ValueError: ``name`` is empty.
    """
    if not name.strip():
        raise ValueError("dataset name must not be empty")
    found = session.scalars(select(Dataset).where(Dataset.name == name)).one_or_none()
    if found is not None:
        return found
    insert_ignore(session, Dataset, {"name": name, "created_at": utcnow()}, ("name",))
    return session.scalars(select(Dataset).where(Dataset.name == name)).one()


def upsert_dataset_version(
    session: Session,
    *,
    dataset_name: str,
    data_version: str,
    bucket: str,
    prefix: str,
    manifest_key: str,
    manifest_etag: str,
    manifest_version_id: str | None,
    objects: Mapping[str, Mapping[str, Any]],
) -> DatasetVersion:
    """Record a dataset version, or return the one already recorded for it.

    Args:
        session: An open session.
        dataset_name: The dataset it belongs to (created if new).
        data_version: sha256 of the manifest bytes, 64 lowercase hex characters.
        bucket: Bucket holding the objects.
        prefix: Key prefix of the version's folder.
        manifest_key: Key of the manifest.
        manifest_etag: ETag of the manifest object.
        manifest_version_id: S3 version id of the manifest; None on an unversioned bucket.
        objects: Relative path -> ``{"version_id", "etag", "size"}`` of every object the manifest lists.

    Returns:
        The row for (dataset, data_version). When it exists already it is returned unchanged: the data
        version is a content hash, so the first record of it stands.

    Raises:
        ValueError: ``data_version`` is not a sha256 hex digest.
    """
    check_hex("data_version", data_version, 64)
    dataset = get_or_create_dataset(session, dataset_name)
    key = (DatasetVersion.dataset_id == dataset.id, DatasetVersion.data_version == data_version)
    found = session.scalars(select(DatasetVersion).where(*key)).one_or_none()
    if found is not None:
        return found
    values = {
        "dataset_id": dataset.id,
        "data_version": data_version,
        "bucket": bucket,
        "prefix": prefix,
        "manifest_key": manifest_key,
        "manifest_etag": manifest_etag,
        "manifest_version_id": manifest_version_id,
        "objects": {path: dict(meta) for path, meta in objects.items()},
        "num_objects": len(objects),
        "created_at": utcnow(),
    }
    insert_ignore(session, DatasetVersion, values, ("dataset_id", "data_version"))
    return session.scalars(select(DatasetVersion).where(*key)).one()


def find_dataset_version(session: Session, data_version_or_prefix: str) -> DatasetVersion | None:
    """Find a dataset version by its full data version or a unique prefix of it.

    Args:
        session: An open session.
        data_version_or_prefix: 7 to 64 hex characters (case-insensitive), e.g. the ``data7`` part of a
            model version.

    Returns:
        The matching row, or None when nothing matches.

    Raises:
        ValueError: the argument is not hex or shorter than 7 characters.
        LookupError: more than one dataset version matches; the message lists them.
    """
    text = data_version_or_prefix.strip().lower()
    if len(text) < MIN_PREFIX or len(text) > 64 or not HEX.fullmatch(text):
        raise ValueError(
            f"data version {data_version_or_prefix!r} must be {MIN_PREFIX} to 64 hex characters "
            "(a sha256 of the manifest or a prefix of it)"
        )
    column = DatasetVersion.data_version
    # Validated as hex above, so the prefix holds no LIKE wildcards.
    condition = column == text if len(text) == 64 else column.startswith(text)
    rows = session.scalars(select(DatasetVersion).where(condition).order_by(DatasetVersion.id).limit(6)).all()
    if len(rows) <= 1:
        return rows[0] if rows else None
    shown = ", ".join(f"{row.dataset.name}@{row.data_version[:12]}" for row in rows[:5])
    more = " and more" if len(rows) > 5 else ""
    raise LookupError(f"data version {text!r} is ambiguous: it matches {shown}{more}; give more hex characters")


def latest_dataset_version(session: Session, dataset_name: str | None = None) -> DatasetVersion | None:
    """The most recently recorded dataset version.

    Args:
        session: An open session.
        dataset_name: Only versions of this dataset; None: of any dataset.

    Returns:
        The newest row by record time, or None when there is none.
    """
    query = select(DatasetVersion).order_by(DatasetVersion.created_at.desc(), DatasetVersion.id.desc())
    if dataset_name is not None:
        query = query.join(Dataset).where(Dataset.name == dataset_name)
    return session.scalars(query.limit(1)).first()
