"""The one place errors become gRPC statuses: a ServingError carries its code and a message that names the
field and the fix (cut to ``DETAILS_CHARS``); anything else is INTERNAL and logged with its traceback (the
client gets no internals).

Applied by wrapping each RPC method once, at registration, rather than as a ``grpc.ServerInterceptor``:
grpcio runs interceptors on every call and builds a new method handler each time, a measurable share
of a small model's request at thousands of requests a second.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from serving.errors import DETAILS_CHARS, ServingError, clip

log = logging.getLogger(__name__)

Method = Callable[[Any, grpc.ServicerContext], Any]


def guarded(method: Method, name: str) -> Method:
    """``method`` with ServingError mapped to its status and anything else to INTERNAL."""

    @functools.wraps(method)
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(request, context)
        except ServingError as exc:
            # Clipped here, whatever raised it: messages built elsewhere may echo a request field whole.
            code, details = exc.code, clip(str(exc), DETAILS_CHARS)
        except Exception:
            log.exception("%s failed", name)
            code, details = grpc.StatusCode.INTERNAL, f"internal error in {name}; see the server log"
        # Aborted outside the except blocks: abort raises, and raised inside one its exception would chain
        # the caught one, whose traceback holds this frame holding it, a cycle only the garbage collector
        # frees; until it ran, each refused 4 MiB request stayed in memory.
        context.abort(code, details)

    return call


def guard_servicer(servicer: Any, service: str, methods: list[str]) -> Any:
    """Replace each of ``methods`` on ``servicer`` (an instance) by its guarded version; returns it."""
    for name in methods:
        setattr(servicer, name, guarded(getattr(servicer, name), f"/{service}/{name}"))
    return servicer
