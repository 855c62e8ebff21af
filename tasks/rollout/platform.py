"""The one interface every rollout platform implements, and the state it reports.

A platform moves traffic between the stable version of a model and a canary version. Every method is
idempotent: calling it again after a crash (or twice in a row) finds the state the first call left and
finishes it, so a rollout flow re-run from any step converges. ``state`` is how a re-run learns where
the previous run stopped; platforms keep it where they act (Kubernetes: annotations on the
Deployments; local: the server's loaded versions and weights), never in process memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluicegate.errors import SluicegateError


class PlatformError(SluicegateError):
    """The platform could not do what was asked (timeout, refused call); the message names the object
    and the fix."""


@dataclass(frozen=True)
class PlatformState:
    """Where a model's traffic is now."""

    model: str
    stable_version: str | None  # None: nothing deployed yet
    canary_version: str | None  # None: no canary
    canary_weight: int  # percent of traffic on the canary, 0..100
    previous_stable_version: str | None = None  # what stable ran before the last promotion, for rollback


class RolloutPlatform(Protocol):
    """Moves traffic for one model between its stable and canary versions."""

    name: str  # "kubernetes" or "local"

    def state(self, model: str) -> PlatformState:
        """The model's current versions and weights (a fresh read, not a cache)."""
        ...

    def start_canary(self, model: str, version: str) -> PlatformState:
        """Deploy ``version`` beside stable with 0% of the traffic and wait until it is ready.

        Raises:
            PlatformError: it did not become ready in time (the canary is left for ``rollback``).
        """
        ...

    def set_weight(self, model: str, canary_percent: int) -> PlatformState:
        """Send ``canary_percent`` of the traffic to the canary, the rest to stable."""
        ...

    def promote(self, model: str) -> PlatformState:
        """Make the canary version the stable one (stable rolled to it and ready), 100% on stable, the
        canary removed."""
        ...

    def rollback(self, model: str) -> PlatformState:
        """100% on stable and the canary removed; where stable itself was changed by a promotion that
        did not finish, stable is put back on its previous version."""
        ...
