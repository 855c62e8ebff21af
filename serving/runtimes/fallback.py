"""A runtime that falls back: TensorRT -> ONNX Runtime -> rules (DESIGN section 6).

Levels are tried in order at load; the first that loads serves. Repeated runtime errors drop one level,
and while a version runs below its best level a background probe retries the better levels and climbs
back once one loads and answers a probe batch. Every change is logged and reported through ``on_change``
(metrics hook in there).

Concurrency: ``infer`` runs outside the lock, so concurrent batches run in parallel on the current
runtime. A runtime that is replaced while batches are still on it is closed only when the last of them
returns, so a level change never pulls a session out from under a running batch. Level changes (drop,
probe, close) are serialised by a second lock, so two of them never interleave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from serving.errors import InvalidInput, ModelNotReady, RuntimeFailure, ServingError
from serving.runtimes.base import Array, Runtime

log = logging.getLogger(__name__)

Loader = Callable[[], Runtime]
OnChange = Callable[[str, int, str], None]
_JOIN_TIMEOUT_S = 30.0  # close() waits this long for a probe that is loading a model


@dataclass(eq=False)
class _Active:
    """The runtime of one level while it serves, with the batches still running on it."""

    runtime: Runtime
    index: int
    in_flight: int = 0
    retired: bool = False


class FallbackRuntime:
    """Runs batches on the best level that works, and moves between levels as they break and heal.

    Args:
        levels: ``(level name, loader)`` pairs, best first; a loader returns a loaded runtime or raises.
        max_consecutive_errors: runtime errors in a row (from any callers) that drop one level. Invalid
            input is the caller's fault and does not count.
        probe_interval_s: how often, while below level 0, the probe retries the better levels (0: never).
        probe_input: the batch a probe runs on a freshly loaded level before switching to it; None
            switches on a successful load alone.
        on_change: called with (level name, level index, reason) after every level change.

    Raises:
        RuntimeFailure: no level loaded; the message lists each level's reason.
    """

    def __init__(
        self,
        levels: Sequence[tuple[str, Loader]],
        *,
        max_consecutive_errors: int = 5,
        probe_interval_s: float = 30.0,
        probe_input: Mapping[str, Array] | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        if not levels:
            raise RuntimeFailure("FallbackRuntime needs at least one level: none were given")
        if max_consecutive_errors < 1:
            raise ValueError(f"max_consecutive_errors is {max_consecutive_errors}: it must be at least 1")
        self._levels = list(levels)
        self._max_errors = max_consecutive_errors
        self._probe_interval_s = probe_interval_s
        self._probe_input = dict(probe_input) if probe_input is not None else None
        self._on_change = on_change
        self._state = threading.Lock()  # guards _active, _errors, _failures
        # Serialises level changes; taken before _state, never after. Re-entrant so an on_change hook
        # that closes the runtime (called while a change holds it) does not deadlock.
        self._switching = threading.RLock()
        self._stop = threading.Event()
        self._probe_thread: threading.Thread | None = None
        self._failures: list[str] = []
        self._errors = 0
        self._active: _Active | None = self._load_first(0, len(self._levels))
        if self._active is None:
            raise RuntimeFailure("no runtime could load: " + "; ".join(self._failures))
        if self._active.index > 0:
            with self._switching:
                self._ensure_probe()

    # -- the Runtime interface ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The current level's runtime name ("none" when no level is left)."""
        active = self._active
        return active.runtime.name if active is not None else "none"

    @property
    def providers(self) -> tuple[str, ...]:
        active = self._active
        return tuple(active.runtime.providers) if active is not None else ()

    @property
    def level_index(self) -> int:
        """0 for the best level; ``len(levels)`` when no level is left."""
        active = self._active
        return active.index if active is not None else len(self._levels)

    @property
    def level_name(self) -> str:
        active = self._active
        return self._levels[active.index][0] if active is not None else "none"

    @property
    def abnormal(self) -> bool:
        """Whether the current level's answers are flagged (the rules level's are)."""
        active = self._active
        return active is not None and bool(getattr(active.runtime, "abnormal", False))

    @property
    def failures(self) -> list[str]:
        """Why each level failed to load or was dropped, oldest first."""
        with self._state:
            return list(self._failures)

    def infer(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """Run a batch on the current level.

        Raises:
            InvalidInput: from the runtime, unchanged (not counted as a runtime error).
            ModelNotReady: no level is left (the probe may still bring one back).
            RuntimeFailure: the runtime failed; after ``max_consecutive_errors`` in a row the level drops.
        """
        with self._state:
            active = self._active
            if active is None:
                if self._stop.is_set():
                    raise ModelNotReady("this model version is unloaded (its runtime is closed): load it again")
                raise ModelNotReady("no runtime level is left for this model: " + "; ".join(self._failures[-3:]))
            active.in_flight += 1
        try:
            outputs = active.runtime.infer(inputs)
        except InvalidInput:
            self._release(active, error=None)
            raise
        except Exception as exc:
            self._release(active, error=exc)
            if isinstance(exc, ServingError):
                raise
            raise RuntimeFailure(f"{active.runtime.name} (level {active.index}) failed: {exc}") from exc
        self._release(active, error=None, success=True)
        return outputs

    def close(self) -> None:
        """Stop the probe and close the current runtime (once its running batches return)."""
        self._stop.set()
        thread = self._probe_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)
        with self._switching:
            self._replace(None)

    # -- errors and dropping ---------------------------------------------------------------------

    def _release(self, active: _Active, *, error: Exception | None, success: bool = False) -> None:
        drop = False
        with self._state:
            active.in_flight -= 1
            close_now = active.retired and active.in_flight == 0
            if self._active is active:  # errors of a replaced runtime say nothing about the current one
                if success:
                    self._errors = 0
                elif error is not None:
                    self._errors += 1
                    drop = self._errors >= self._max_errors
        if close_now:
            _close(active.runtime)
        if drop:
            assert error is not None
            self._drop(active, f"{self._max_errors} consecutive errors on {active.runtime.name}, last: {error}")

    def _drop(self, active: _Active, reason: str) -> None:
        with self._switching:
            if self._active is not active or self._stop.is_set():
                return  # another caller already dropped it, or we are closing
            with self._state:
                self._failures.append(f"{self._levels[active.index][0]}: dropped: {reason}")
            log.warning("dropping runtime level %s: %s", self._levels[active.index][0], reason)
            below = self._load_first(active.index + 1, len(self._levels))
            self._replace(below)
            if below is None:
                log.error("no runtime level left after dropping %s", self._levels[active.index][0])
                self._notify("none", len(self._levels), reason)
            else:
                self._notify(self._levels[below.index][0], below.index, reason)
            self._ensure_probe()

    def _load_first(self, start: int, stop: int) -> _Active | None:
        """Load the first level in ``[start, stop)`` that loads, recording why the others did not."""
        for index in range(start, stop):
            name, loader = self._levels[index]
            try:
                return _Active(loader(), index)
            except Exception as exc:
                reason = f"{name}: {exc}"
                log.warning("runtime level %s did not load: %s", name, exc)
                with self._state:
                    self._failures.append(reason)
        return None

    def _replace(self, new: _Active | None) -> None:
        """Make ``new`` current; the old runtime closes now, or when its last running batch returns."""
        with self._state:
            old, self._active, self._errors = self._active, new, 0
            close_now = False
            if old is not None:
                old.retired = True
                close_now = old.in_flight == 0
        if old is not None and close_now:
            _close(old.runtime)

    def _notify(self, level: str, index: int, reason: str) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(level, index, reason)
        except Exception:  # a broken metrics hook must not break serving
            log.exception("on_change(%s, %d) failed", level, index)

    # -- probing back up -------------------------------------------------------------------------

    def _ensure_probe(self) -> None:
        """Start the probe thread if below level 0 and none runs. Called with ``_switching`` held."""
        if self._probe_interval_s <= 0 or self._stop.is_set() or self.level_index == 0:
            return
        if self._probe_thread is not None and self._probe_thread.is_alive():
            return
        self._probe_thread = threading.Thread(target=self._probe_loop, name="runtime-probe", daemon=True)
        self._probe_thread.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._probe_interval_s):
            with self._switching:
                if self._stop.is_set():
                    return
                if self.level_index == 0:
                    # Decided under _switching, so a drop racing with this exit starts a new thread.
                    self._probe_thread = None
                    return
                self._probe_once()

    def _probe_once(self) -> None:
        """Try each level above the current one, best first; switch to the first that loads and answers."""
        for index in range(self.level_index):
            name, loader = self._levels[index]
            try:
                runtime = loader()
            except Exception as exc:
                log.info("probe: %s still does not load: %s", name, exc)
                continue
            try:
                if self._probe_input is not None:
                    runtime.infer(self._probe_input)
            except Exception as exc:
                log.info("probe: %s loads but fails the probe batch: %s", name, exc)
                _close(runtime)
                continue
            reason = f"probe: {name} loads and answers again"
            log.warning("restoring runtime level %s (%s)", name, reason)
            self._replace(_Active(runtime, index))
            self._notify(name, index, reason)
            return


def _close(runtime: Runtime) -> None:
    try:
        runtime.close()
    except Exception:  # closing is best effort: the level is gone either way
        log.exception("closing runtime %s failed", runtime.name)
