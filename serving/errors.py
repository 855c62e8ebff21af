"""One error hierarchy for the server; each error carries its gRPC status and its HTTP one. Each transport
maps them in one place: serving/grpc_api/rpc_errors.py (gRPC statuses) and
serving/rest_api/side_port.py (HTTP); anything else is INTERNAL / 500, logged with its traceback.
Messages name the field, the value and the fix."""

from __future__ import annotations

import grpc


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


class RepositoryError(ServingError):
    """A model version is missing, altered, incomplete or unsafe; the message names the file and the fix."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class RuntimeFailure(ServingError):
    """A runtime could not load or run a model (the fallback chain decides what happens next)."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500
