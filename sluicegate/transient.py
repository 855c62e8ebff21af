"""Which failures are worth retrying: a dependency that is away for a moment, not a bug or bad input.

``is_transient`` decides from the exception alone, for every client the platform talks through
(botocore for S3/SQS, requests/urllib3 under MLflow, httpx, SQLAlchemy over psycopg). It imports none
of them: an exception of a library's type can only exist once that library is imported, so each check
looks the library up in ``sys.modules`` and is skipped when it is absent. Importing this module costs
nothing, and a process that never loaded MLflow never loads it here.

A platform error (``SluicegateError``) is transient only when it wraps a transient failure: the chain of
``__cause__`` (``raise ... from``) and ``__context__`` (raised while handling) is walked, the way a
traceback prints it.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

# OSError errnos of a peer that is down, restarting or unreachable (not of a missing file or a bad path).
_NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.EHOSTDOWN,
        errno.ENETUNREACH,
        errno.ENETDOWN,
    }
)

# HTTP statuses that say "try again later": rate limited, timed out, or the server side is failing.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

# S3/SQS error codes of throttling and server-side trouble (botocore's own standard retry mode uses
# the same families), for responses whose status alone does not say so.
_AWS_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "ServiceUnavailable",
        "InternalError",
    }
)

# MLflow error codes that mean the same on a locally raised MlflowException. INTERNAL_ERROR is not
# among them: it is MlflowException's default, used for client-side errors too.
_MLFLOW_TRANSIENT_CODES = frozenset(
    {"TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED"}
)

# PostgreSQL: SQLSTATE class 08 (connection exception) and the server shutting down or starting up.
_PG_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})
# libpq reports connection failures without a SQLSTATE; these phrases are in its messages.
_PG_DISCONNECT_PHRASES = (
    "connection refused",
    "connection reset",
    "connection timed out",
    "timeout expired",
    "no route to host",
    "network is unreachable",
    "server closed the connection",
    "could not receive data",
    "could not send data",
    "consuming input failed",
    "the connection is lost",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
)

# Only this deep: a chain longer than this is a loop or a pathology, not a cause worth finding.
_MAX_CHAIN = 16


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or the failure it wraps) is a dependency away for a moment, worth retrying.

    True for refused/reset connections and timeouts (builtin, socket, urllib3, requests, httpx,
    botocore), S3 responses with a 5xx status or a throttling code, MLflow requests that failed to
    connect or got a 5xx/429, and database connections that were refused or dropped.
    False for everything else: programming errors, bad input, 4xx responses (``NoSuchKey``,
    ``AccessDenied``), failed gates, configuration errors.

    Args:
        exc: the exception a stage raised.

    Returns:
        True if retrying the same call later can succeed without anyone changing anything.
    """
    return any(_is_transient_one(link) for link in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(current))
        yield current
        if current.__cause__ is not None:
            current = current.__cause__
        elif not current.__suppress_context__:
            current = current.__context__
        else:
            current = None


def _is_transient_one(exc: BaseException) -> bool:
    return any(check(exc) for check in _CHECKS)


def _builtin(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | TimeoutError):  # refused, reset, aborted, broken pipe; socket.timeout
        return True
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN  # "temporary failure in name resolution", not a wrong name
    return isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS


def _module(name: str) -> ModuleType | None:
    return sys.modules.get(name)


def _status_transient(status: Any) -> bool:
    return isinstance(status, int) and status in _RETRY_STATUSES


def _botocore(exc: BaseException) -> bool:
    errors = _module("botocore.exceptions")
    if errors is None:
        return False
    if isinstance(exc, errors.SSLError):  # a certificate problem does not go away by waiting
        return False
    if isinstance(exc, errors.ConnectionError | errors.HTTPClientError):
        # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError, ConnectionClosedError,
        # ReadTimeoutError, ResponseStreamingError
        return True
    if isinstance(exc, errors.ClientError):
        response: dict[str, Any] = getattr(exc, "response", None) or {}
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        return (isinstance(status, int) and status >= 500) or status == 429 or code in _AWS_TRANSIENT_CODES
    return False


def _urllib3(exc: BaseException) -> bool:
    errors = _module("urllib3.exceptions")
    if errors is None:
        return False
    if isinstance(exc, errors.SSLError):
        return False
    if isinstance(exc, errors.MaxRetryError):
        # Retries exhausted: transient if the last reason was (a refused connection, a run of 5xx).
        reason = exc.reason
        return reason is None or isinstance(reason, errors.ResponseError) or is_transient(reason)
    return isinstance(exc, errors.TimeoutError | errors.NewConnectionError | errors.ProtocolError)


def _requests(exc: BaseException) -> bool:
    errors = _module("requests.exceptions")
    if errors is None:
        return False
    if isinstance(exc, errors.SSLError | errors.InvalidURL):
        return False
    if isinstance(exc, errors.HTTPError):
        return _status_transient(getattr(exc.response, "status_code", None))
    # RetryError: urllib3 gave up after a run of retryable statuses (MLflow retries 408/429/5xx itself).
    return isinstance(exc, errors.ConnectionError | errors.Timeout | errors.ChunkedEncodingError | errors.RetryError)


def _httpx(exc: BaseException) -> bool:
    httpx = _module("httpx")
    if httpx is None:
        return False
    if isinstance(exc, httpx.HTTPStatusError):
        return _status_transient(exc.response.status_code)
    return isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError)


def _mlflow(exc: BaseException) -> bool:
    errors = _module("mlflow.exceptions")
    if errors is None or not isinstance(exc, errors.MlflowException):
        return False
    code = getattr(exc, "error_code", None)
    if isinstance(exc, errors.RestException):
        # The server answered with an error: its generic 500 counts too (INVALID_STATE and
        # NOT_IMPLEMENTED, also 5xx, do not: asking again gets the same answer).
        return code in _MLFLOW_TRANSIENT_CODES or code == "INTERNAL_ERROR"
    # Raised on this side: a failed connection is in its context (MLflow raises it inside `except`,
    # and the chain walk finds it); only explicit "unavailable"/"rate limited" codes count by themselves.
    return code in _MLFLOW_TRANSIENT_CODES


def _sqlalchemy(exc: BaseException) -> bool:
    errors = _module("sqlalchemy.exc")
    if errors is None:
        return False
    if isinstance(exc, errors.DisconnectionError | errors.TimeoutError):  # dropped; pool wait timed out
        return True
    if isinstance(exc, errors.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, errors.OperationalError | errors.InterfaceError):
        orig = exc.orig
        return orig is not None and (_psycopg(orig) or _pg_message_transient(orig))
    return False


def _psycopg(exc: BaseException) -> bool:
    psycopg = _module("psycopg")
    if psycopg is None or not isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is not None:
        return str(sqlstate).startswith("08") or sqlstate in _PG_TRANSIENT_SQLSTATES
    return _pg_message_transient(exc)


def _pg_message_transient(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(phrase in text for phrase in _PG_DISCONNECT_PHRASES)


_CHECKS: tuple[Callable[[BaseException], bool], ...] = (
    _builtin,
    _botocore,
    _urllib3,
    _requests,
    _httpx,
    _mlflow,
    _sqlalchemy,
    _psycopg,
)
