"""Who may call what: one ``Authorizer`` for both transports, so gRPC and HTTP refuse the same calls the
same way. Calls that change what is served (repository load/unload, traffic weights, every admin route)
need the admin token; reads (repository index, traffic weights) need it only when
``read_requires_token`` is set. Every refusal is logged with the caller's address and counted."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable

from serving.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

CHANGE, READ = "change", "read"
_DISABLED = (
    "changing calls are disabled: set SLUICEGATE_SERVING__ADMIN_TOKEN on the server "
    "(or SLUICEGATE_SERVING__ADMIN_OPEN=true for local development only)"
)


class Authorizer:
    """Checks the ``Authorization: Bearer <token>`` a call carries.

    Args:
        token: The admin token; None: no token configured.
        open_changes: With no token, let changing calls through (local development).
        reads_need_token: Reads need the token too.
        on_refused: Called with (action, reason) for every refusal (the metrics hook in here).
    """

    def __init__(
        self,
        token: str | None,
        *,
        open_changes: bool = False,
        reads_need_token: bool = False,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        # Compared as digests: hmac.compare_digest is constant-time only between equal lengths, and a
        # digest makes every given value the same length, so the time leaks neither prefix nor length.
        self._digest = _digest(f"Bearer {token}") if token else None
        self.open_changes, self.reads_need_token = open_changes, reads_need_token
        self._on_refused = on_refused

    @property
    def has_token(self) -> bool:
        return self._digest is not None

    def change(self, authorization: str | None, *, peer: str, action: str) -> None:
        """Allow a changing call or raise: ``PermissionDenied`` when changes are disabled (no token and not
        open), ``Unauthenticated`` without the right token."""
        if self._digest is None:
            if self.open_changes:
                return
            self._refuse(action, peer, "disabled", PermissionDenied(_DISABLED))
        self._check(authorization, peer=peer, action=action)

    def read(self, authorization: str | None, *, peer: str, action: str) -> None:
        """Allow a read (index, weights) unless reads need the token and the call lacks it."""
        if not self.reads_need_token:
            return
        if self._digest is None:
            self._refuse(action, peer, "disabled", PermissionDenied(_DISABLED))
        self._check(authorization, peer=peer, action=action)

    def _check(self, authorization: str | None, *, peer: str, action: str) -> None:
        assert self._digest is not None
        if not authorization:
            self._refuse(
                action,
                peer,
                "missing",
                Unauthenticated(f"{action} needs the admin token: send the header authorization: Bearer <token>"),
            )
        elif not hmac.compare_digest(_digest(authorization), self._digest):
            self._refuse(action, peer, "wrong", Unauthenticated(f"{action}: wrong admin token"))

    def _refuse(self, action: str, peer: str, reason: str, error: Exception) -> None:
        log.warning("refused %s from %s: %s token", action, peer or "unknown peer", reason)
        if self._on_refused is not None:
            self._on_refused(action, reason)
        raise error


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
