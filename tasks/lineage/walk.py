"""Lineage walks: follow the metadata store (its repository functions) and MLflow from a model version, a request
id or a data version.

``walk`` decides what the reference is, in an order that cannot mistake one kind for another:

1. a model version: ``v1.0.0-abc1234-def5678`` or a unique prefix of one (starts with ``v`` and a digit),
   or, when MLflow answers, a registry number (under 7 digits) or an alias (``champion``, ``@name``);
2. a data version: 7 to 64 hex characters matching a recorded dataset version;
3. a request id, looked up in the model server's JSON request logs (the server assigns 32 hex
   characters; clients may send any id, so this is the fallback).

A server-assigned request id is hex too, but a random 128-bit id is the prefix of no data version in
practice; ``kind`` forces one interpretation. MLflow being down is not an error: the walk reports what the
metadata store knows and says MLflow was not reachable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import httpx
from sqlalchemy.orm import Session

from sluicegate.errors import SluicegateError
from sluicegate.metadata import ModelVersion
from sluicegate.metadata.datasets import find_dataset_version
from sluicegate.metadata.model_versions import find_model_version, find_model_versions
from tasks.lineage import rows
from tasks.lineage.records import DataLineage, Lineage, MlflowState, ModelLineage
from tasks.lineage.request_logs import RequestLine, find_request

if TYPE_CHECKING:
    from mlflow import MlflowClient

_MODEL_PREFIX = re.compile(r"v\d[0-9a-z.\-]*")
_HEX = re.compile(r"[0-9a-fA-F]{7,64}")
_ALIAS = re.compile(r"@[\w\-]+|champion|challenger")
_REGISTRY_NUMBER = re.compile(r"\d{1,6}")
LOG_HINT = "pass the server's log with --logs PATH (a file or a folder; repeatable), or --logs - to read stdin"


class LineageNotFound(SluicegateError):
    """Nothing matches the reference; the message lists every interpretation tried and why it failed."""


class LineageAmbiguous(SluicegateError):
    """The reference matches several model or dataset versions; the message lists them."""


@dataclass(frozen=True)
class LogQuery:
    """Where to look for request ids: log files (already expanded) and optionally a text stream (stdin)."""

    files: tuple[Path, ...] = ()
    stream: IO[str] | None = None


def connect_mlflow(tracking_uri: str, timeout_s: float = 3.0) -> tuple[MlflowState, MlflowClient | None]:
    """A client for ``tracking_uri`` if its server answers within ``timeout_s``, else None and why.

    Checked once up front: MLflow's own client retries a refused connection for minutes.
    """
    from tasks import tracking

    if tracking_uri.startswith(("http://", "https://")):
        try:
            httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s).raise_for_status()
        except httpx.HTTPError as exc:
            return MlflowState(tracking_uri, False, f"{type(exc).__name__}: {exc}"), None
    return MlflowState(tracking_uri, True), tracking.client(tracking_uri)


def walk(
    session: Session,
    ref: str,
    *,
    mlflow: MlflowState,
    tracker: MlflowClient | None,
    model_name: str,
    logs: LogQuery,
    kind: Literal["auto", "model", "data", "request"] = "auto",
    with_objects: bool = False,
) -> Lineage:
    """The lineage of ``ref``, whatever kind of reference it is (see the module docstring for the order).

    Args:
        session: An open metadata-store session.
        ref: A model version (or prefix, registry number, alias), a data version (or prefix), a request id.
        mlflow: The tracking server and whether it answered (``connect_mlflow``).
        tracker: A client for it, None when it did not answer.
        model_name: The registered model that registry numbers and aliases refer to.
        logs: Where request ids are looked up.
        kind: ``"auto"`` tries each kind in order; any other value tries only that one.
        with_objects: List every S3 object of the dataset version, not only their count.

    Returns:
        The walk, with notes on anything that could not be followed (e.g. MLflow down).

    Raises:
        LineageNotFound: no kind matched; the message says what was tried and how to fix it.
        LineageAmbiguous: a prefix matches several versions.
    """
    ref = ref.strip()
    walker = rows.Walker(session, tracker, mlflow.url, with_objects)
    tried: list[str] = []
    if kind in ("auto", "model"):
        row = _model_row(session, ref, model_name, mlflow, tried, forced=kind == "model")
        if row is not None:
            return Lineage("model", ref, mlflow, model=walker.model(row), notes=tuple(walker.notes))
    if kind in ("auto", "data"):
        found = _data(walker, ref, tried, forced=kind == "data")
        if found is not None:
            return Lineage("data", ref, mlflow, data=found, notes=tuple(walker.notes))
    if kind in ("auto", "request"):
        request, model = _request(walker, ref, logs, tried)
        if request is not None:
            return Lineage("request", ref, mlflow, request=request, model=model, notes=tuple(walker.notes))
    raise LineageNotFound(f"nothing matches {ref!r}; tried " + "; ".join(tried))


def _model_row(
    session: Session, ref: str, model_name: str, mlflow: MlflowState, tried: list[str], *, forced: bool
) -> ModelVersion | None:
    if _MODEL_PREFIX.fullmatch(ref) or forced:
        found = find_model_versions(session, ref, model_name)
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(f"{r.model_name} {r.version}" for r in found[:5])
            raise LineageAmbiguous(f"model version {ref!r} is ambiguous: it matches {names}; give more of it")
        tried.append(f"model version: no recorded model version is {ref!r} or starts with it")
    if _REGISTRY_NUMBER.fullmatch(ref) or _ALIAS.fullmatch(ref):
        return _registry_row(session, ref, model_name, mlflow, tried)
    return None


def _registry_row(
    session: Session, ref: str, model_name: str, mlflow: MlflowState, tried: list[str]
) -> ModelVersion | None:
    from tasks import registry

    what = f"registry version/alias of {model_name!r}"
    if not mlflow.reachable:
        tried.append(f"{what}: MLflow at {mlflow.url} is not reachable, so registry numbers and aliases cannot be read")
        return None
    try:
        found = registry.resolve(mlflow.url, model_name, ref)
    except SluicegateError as exc:
        tried.append(f"{what}: {exc}")
        return None
    row = find_model_version(session, found.name, found.model_version)
    if row is None:
        tried.append(f"{what}: {found.describe()} is registered but not in the metadata store")
    return row


def _data(walker: rows.Walker, ref: str, tried: list[str], *, forced: bool) -> DataLineage | None:
    if not _HEX.fullmatch(ref):
        if forced:
            tried.append(f"data version: {ref!r} is not 7 to 64 hex characters")
        return None
    try:
        version = find_dataset_version(walker.session, ref)
    except LookupError as exc:
        raise LineageAmbiguous(str(exc)) from exc
    if version is None:
        tried.append(f"data version: no recorded dataset version starts with {ref.lower()!r}")
        return None
    return walker.data(version)


def _request(
    walker: rows.Walker, ref: str, logs: LogQuery, tried: list[str]
) -> tuple[RequestLine | None, ModelLineage | None]:
    if not logs.files and logs.stream is None:
        tried.append(f"request id: no request logs to search; {LOG_HINT}")
        return None, None
    search = find_request(ref, logs.files, logs.stream)
    line = search.latest
    if line is None:
        where = ", ".join(search.searched[:5]) + (
            f" and {len(search.searched) - 5} more" if len(search.searched) > 5 else ""
        )
        tried.append(f"request id: not in the request logs searched ({where}); if it is elsewhere, {LOG_HINT}")
        return None, None
    if len(search.matches) > 1:
        walker.notes.append(f"request id {ref!r} appears {len(search.matches)} times; following the latest")
    row = find_model_version(walker.session, line.model_name, line.model_version)
    if row is None:
        walker.notes.append(
            f"model {line.model_name} version {line.model_version!r} from the request log is not in the metadata store"
        )
        return line, None
    return line, walker.model(row)
