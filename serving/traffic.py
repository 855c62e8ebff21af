"""Traffic weights between the loaded versions of one model (canary and A/B rollouts).

A request that names a version gets that version; one that does not is routed here: weighted random
among the loaded versions with a positive weight, or, with no weights set, the newest loaded version
(Triton's ``latest`` policy). Weights describe intent and survive loads; a version unloaded later is
simply no longer a candidate, and when no weighted version is loaded the newest one serves.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Collection, Mapping, Sequence

from serving.errors import InvalidInput, ModelNotFound, ModelNotReady, clip

# Largest weight of one version: enough for percent, per-mille or per-million shares, while the sum of
# every weight stays an ordinary float for random.choices (10**400 made every unversioned request fail).
MAX_WEIGHT = 1_000_000
# Most entries one update may name; far above any model's loaded versions, so only a hostile body hits it.
MAX_ENTRIES = 1000


class TrafficSplitter:
    """Routes unversioned requests between a model's loaded versions; safe to share between threads.

    Args:
        seed: Seeds the random choice, for reproducible tests; None seeds from the system.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._weights: dict[str, dict[str, int]] = {}

    def set_weights(self, model: str, weights: Mapping[str, int], loaded: Collection[str]) -> dict[str, int]:
        """Replace the model's weights.

        Args:
            model: The model name.
            weights: Version to an integer weight in 0..``MAX_WEIGHT``; the weights must sum to more than 0.
            loaded: The versions loaded now; every version named in ``weights`` must be one of them.

        Returns:
            The weight of every loaded version, 0 for those not named.

        Raises:
            ModelNotFound: A named version is not loaded (the message lists the loaded ones).
            InvalidInput: More than ``MAX_ENTRIES`` entries, a version that is not a string, a weight that is
                not an integer in 0..``MAX_WEIGHT``, or all weights 0.
        """
        # Every transport's values come through here (gRPC's uint32, JSON's unbounded integers), so this is
        # the check they all rely on. The count first: nothing below walks an unbounded mapping.
        if len(weights) > MAX_ENTRIES:
            raise InvalidInput(
                f"model {clip(model)!r}: {len(weights)} traffic weights; expected at most {MAX_ENTRIES}, one per "
                "loaded version"
            )
        for version, weight in weights.items():
            if not isinstance(version, str):
                raise InvalidInput(f"model {clip(model)!r}: version {clip(repr(version))} is not a string")
            # bool is an int subclass, and True as a weight is almost certainly a mistake.
            if not isinstance(weight, int) or isinstance(weight, bool) or not 0 <= weight <= MAX_WEIGHT:
                raise InvalidInput(
                    f"model {clip(model)!r}: weight of version {clip(version)!r} is {_shown(weight)}; use a "
                    f"non-negative integer up to {MAX_WEIGHT}"
                )
            if version not in loaded:
                raise ModelNotFound(
                    f"model {clip(model)!r}: version {clip(version)!r} in the traffic weights is not loaded;"
                    f" loaded versions: {sorted(loaded)}"
                )
        if sum(weights.values()) <= 0:
            raise InvalidInput(
                f"model {clip(model)!r}: traffic weights {dict(weights)} sum to 0; give a version a positive weight"
            )
        table = {version: weights.get(version, 0) for version in loaded}
        with self._lock:
            self._weights[model] = table
        return dict(table)

    def weights(self, model: str) -> dict[str, int]:
        """The model's weights as set (empty when none are set: the newest version serves)."""
        with self._lock:
            return dict(self._weights.get(model, {}))

    def clear(self, model: str) -> None:
        """Drop the model's weights, so the newest loaded version serves again."""
        with self._lock:
            self._weights.pop(model, None)

    def forget(self, model: str, version: str) -> None:
        """Drop an unloaded version's weight; with no positive weight left, drop the model's weights."""
        with self._lock:
            table = self._weights.get(model)
            if table is None:
                return
            table.pop(version, None)
            if not any(weight > 0 for weight in table.values()):
                del self._weights[model]

    def route(self, model: str, version: str, loaded: Sequence[str]) -> str:
        """The version to serve a request with: the one it names, else ``choose``.

        A named version is returned as is, whatever the weights: the caller's model table knows
        whether it is unknown (NOT_FOUND) or still loading (UNAVAILABLE), this class does not.
        """
        return version if version else self.choose(model, loaded)

    def choose(self, model: str, loaded: Sequence[str]) -> str:
        """Pick a version for a request that names none.

        Args:
            model: The model name.
            loaded: Its loaded versions in load order (the last is the newest).

        Returns:
            A weighted random pick among loaded versions with a positive weight; the newest loaded
            version when no weights are set or none of the weighted versions is loaded.

        Raises:
            ModelNotReady: No version of the model is loaded.
        """
        if not loaded:
            raise ModelNotReady(f"model {model!r} has no loaded version; load one or wait for loading to finish")
        with self._lock:
            table = self._weights.get(model)
            if table is None:
                return loaded[-1]
            candidates = [version for version in loaded if table.get(version, 0) > 0]
            if not candidates:
                return loaded[-1]
            if len(candidates) == 1:
                return candidates[0]
            # Renormalised over what is loaded now: a weighted version being unloaded shifts its
            # share to the others instead of failing requests.
            return self._random.choices(candidates, weights=[table[version] for version in candidates])[0]


def _shown(weight: object) -> str:
    """A refused weight for the message: a huge integer by its size (repr of one past 4300 digits raises)."""
    if isinstance(weight, int) and not -(10**18) < weight < 10**18:
        return f"an integer of {weight.bit_length()} bits"
    return clip(repr(weight))
