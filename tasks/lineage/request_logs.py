"""Finding a served request in the model server's JSON request logs (``serving/observability/logs.py``).

The server writes one JSON object per line; a request's own line comes from the ``serving.requests``
logger and carries ``REQUEST_FIELDS`` (request id, model name and version, input digest, ...). Other
lines (startup messages, warnings bound to the request's context, anything a native library prints)
are skipped. The request id is whatever the client sent, or 32 hex characters the server assigned.

The input digest is ``"xxh3-128:<32 hex>"`` (field ``input_digest``); lines written before it carry a
bare sha256 hex in ``input_hash``, read here as ``"sha256:<64 hex>"``, so the algorithm is always named.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from serving.observability.logs import REQUEST_LOGGER

DEFAULT_PREFIX = "serving"  # <home>/logs/serving.log, its rotations serving.log.1, serving.log.2.gz, ...
STDIN = "-"


@dataclass(frozen=True)
class RequestLine:
    """One request as the server logged it, and where the line was found (``path:line``)."""

    request_id: str
    model_name: str
    model_version: str
    input_digest: str | None  # "<algorithm>:<hex>" (xxh3-128, or sha256 in older logs)
    timestamp: str
    status: str
    runtime: str | None
    batch_size: int | None
    inference_time_ms: float | None
    trace_id: str | None
    source: str


@dataclass(frozen=True)
class RequestSearch:
    """The outcome of a search: every matching line (oldest first) and what was searched."""

    matches: tuple[RequestLine, ...]
    searched: tuple[str, ...]

    @property
    def latest(self) -> RequestLine | None:
        return self.matches[-1] if self.matches else None


def default_log_files(logs_dir: Path) -> list[Path]:
    """The local model server's log and its rotations under ``logs_dir`` (empty when there are none)."""
    if not logs_dir.is_dir():
        return []
    return sorted(p for p in logs_dir.iterdir() if p.is_file() and p.name.startswith(DEFAULT_PREFIX))


def expand(paths: Sequence[Path]) -> list[Path]:
    """Files to read: a file as given, a directory's regular files (not recursive), sorted.

    Raises:
        FileNotFoundError: a path does not exist (the message names it).
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.is_file())
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"log path {path} does not exist")
    return files


def find_request(request_id: str, files: Sequence[Path], stream: IO[str] | None = None) -> RequestSearch:
    """Every request line for ``request_id`` in ``files`` and ``stream`` (e.g. stdin), oldest first.

    Args:
        request_id: The id exactly as the server logged it.
        files: Log files; ``.gz`` files are read compressed. Undecodable bytes are replaced, not fatal.
        stream: A text stream of log lines, read to its end (``kubectl logs ... | sluicegate lineage``).

    Returns:
        The matches sorted by their timestamp, and the names of what was searched.
    """
    found: list[RequestLine] = []
    searched: list[str] = []
    for path in files:
        searched.append(str(path))
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            found += _scan(request_id, handle, str(path))
    if stream is not None:
        searched.append("<stdin>")
        found += _scan(request_id, stream, "<stdin>")
    return RequestSearch(tuple(sorted(found, key=lambda line: line.timestamp)), tuple(searched))


def _scan(request_id: str, lines: Iterable[str], name: str) -> Iterator[RequestLine]:
    for number, text in enumerate(lines, start=1):
        if request_id not in text:  # cheap test first: most lines are other requests
            continue
        record = _parse(text)
        if record is not None and record.get("request_id") == request_id:
            yield _line(record, f"{name}:{number}")


def _parse(text: str) -> dict[str, Any] | None:
    start = text.find("{")  # a collector may prefix lines (e.g. `kubectl logs --timestamps`)
    if start < 0:
        return None
    try:
        record = json.loads(text[start:])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("logger") != REQUEST_LOGGER:
        return None
    return record


def _line(record: dict[str, Any], source: str) -> RequestLine:
    def text(key: str) -> str | None:
        value = record.get(key)
        return None if value is None else str(value)

    def number(key: str) -> float | None:
        value = record.get(key)
        return float(value) if isinstance(value, int | float) else None

    batch = record.get("batch_size")
    return RequestLine(
        request_id=str(record["request_id"]),
        model_name=str(record.get("model_name") or ""),
        model_version=str(record.get("model_version") or ""),
        input_digest=_digest(record),
        timestamp=str(record.get("timestamp") or ""),
        status=str(record.get("status") or ""),
        runtime=text("runtime"),
        batch_size=batch if isinstance(batch, int) else None,
        inference_time_ms=number("inference_time_ms"),
        trace_id=text("trace_id"),
        source=source,
    )


def _digest(record: dict[str, Any]) -> str | None:
    value = record.get("input_digest")
    if value is not None:
        return str(value)
    legacy = record.get("input_hash")  # before XXH3: a bare sha256 hex
    return None if legacy is None else f"sha256:{legacy}"
