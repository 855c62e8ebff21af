"""One error hierarchy for the server; each error carries its gRPC status and its HTTP one. Each transport
maps them in one place: serving/grpc_api/rpc_errors.py (gRPC statuses) and
serving/rest_api/app.py (HTTP); anything else is INTERNAL / 500, logged with its traceback.
Messages name the field, the value and the fix."""

from __future__ import annotations

import grpc

# The default of ServingSettings.max_echo_chars, for code that has no settings at hand.
ECHO_CHARS = 200
# Longest status message a client gets: messages are built for a few clipped fields plus fixed text, and
# gRPC carries them in a trailer (8 KiB by default with grpcio), so a longer one echoes something unclipped.
DETAILS_CHARS = 1024


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with the number cut, for echoing a request field in a log line or
    an error: a 4 MiB model name must not become a 4 MiB log line. Returns ``text`` itself when short."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...(+{len(text) - limit} chars)"


class ServingError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500


class ModelNotFound(ServingError):
    """Unknown model, or unknown version of a known model."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class InvalidInput(ServingError):
    """A request that can never succeed as sent: wrong dtype, shape, byte length, count, batch size."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class ModelNotReady(ServingError):
    """The model exists but is loading, unloading or has no working runtime."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Overloaded(ServingError):
    """The model version's queue is full: retry later (back-pressure instead of unbounded memory)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unauthenticated(ServingError):
    """An admin call without the right token."""

    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDenied(ServingError):
    """A changing call while changing calls are disabled (no admin token set and admin_open off)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class BodyRefused(ServingError):
    """An HTTP-level refusal of a request body (413 too large, 408 too slow, 415 wrong content type);
    ``close``: the rest of the body was not read, so the connection must close after the answer."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.http_status, self.close = status, close
        # Counted under the gRPC name a client of that transport would have seen.
        if status == 408:
            self.code = grpc.StatusCode.DEADLINE_EXCEEDED
        elif status == 413:
            self.code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ClientGone(ServingError):
    """The client disconnected while its request was being read; nobody is left to answer."""

    code = grpc.StatusCode.CANCELLED
    http_status = 499  # nginx's "client closed request"; never sent, the connection is gone


class RepositoryError(ServingError):
    """A model version is missing, altered, incomplete or unsafe; the message names the file and the fix."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class RuntimeFailure(ServingError):
    """A runtime could not load or run a model (the fallback chain decides what happens next)."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500
