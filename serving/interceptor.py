"""The one place errors become gRPC statuses: a ServingError carries its code and a message that names the
field and the fix; anything else is INTERNAL and logged with its traceback (the client gets no internals)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from serving.errors import ServingError

log = logging.getLogger(__name__)


class ErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return inner(request, context)
            except ServingError as exc:
                context.abort(exc.code, str(exc))
            except Exception:
                log.exception("%s failed", method)
                context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
