"""How the server process uses the C library's allocator: set once, at process start, before any thread."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def bound_heap_retention(threshold: int = 4 << 20, arenas: int = 2, trim_threshold: int = 32 << 20) -> bool:
    """Make glibc give freed large blocks back: every allocation from ``threshold`` up mapped on its own and
    unmapped when freed, and at most ``arenas`` heaps; the rest is returned by ``start_trimmer``, not on
    every ``free`` (``trim_threshold``); returns whether all three were set (False where the C library is
    not glibc).

    By default glibc raises the threshold to the size of each large block freed (up to 32 MiB), so after
    one big request later ones come from the heaps, and it keeps up to 8 heaps per core, one per thread
    that allocates, each holding what its thread freed: with 64 gRPC threads, five requests with 4 MiB
    model names left the server 30-50 % above its start-up RSS for good (two heaps: 10 %). A fixed
    threshold stops the ratchet. 4 MiB rather than glibc's 128 KiB floor: at 128 KiB every batch the
    batcher joins (8 x 48 KiB for the small model) was a fresh mmap, zero-filled page by page and unmapped
    after, 11 % of small-model throughput; what the heaps keep below 4 MiB the trimmer gives back.
    Process-wide, and a heap limit only binds threads started after it: ``python -m serving`` calls it
    first thing.

    Fixing the mmap threshold also fixes glibc's trim threshold at its 128 KiB default: whenever a heap's
    free top grew past that, ``free`` gave it back to the kernel, and the next batch faulted it in again,
    page by page (2-7 minor faults per small-model request at c=32, the telemetry's held batches making it
    worse; 0.2-0.3 with a high threshold). The trimmer thread gives back what a burst leaves, so the heaps
    keep up to ``trim_threshold`` of free top only until its next tick.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        bool(mallopt(param, value))
        for param, value in (
            (_M_MMAP_THRESHOLD, threshold),
            (_M_ARENA_MAX, arenas),
            (_M_TRIM_THRESHOLD, trim_threshold),
        )
    )


@dataclass
class TrimPolicy:
    """When the trimmer thread trims: fed one RSS reading per tick, told what each trim achieved.

    The floor is the lowest RSS seen since the last trim that settled (gave the memory back). A reading
    ``growth_bytes`` above it asks for a trim. A trim can find the memory still in use: on a busy machine
    it lands while a large request is still being answered. Taking that RSS as the new floor (the first
    policy) meant no later reading ever rose far enough above it to trim again, and the freed request
    stayed in the heaps for good (CI: +31 MiB after a 40 MB probe). So an unproductive trim is retried
    every tick for ``eager_tries`` tries, then with doubling back-off (a server that really grew pays
    little), and only after ``accept_after_s`` of high readings is the higher RSS taken as the working set
    (a model loaded later). The back-off is for what those trims could not give back: a reading
    ``growth_bytes`` above the RSS the last of them left is new memory (a flood while a model load's growth
    was backing off), and is tried at once, else it could wait a minute.

    A busy process (at least ``busy_cpu_share`` of a core over the last tick) is trimmed at most once per
    ``busy_interval_s``: under steady traffic the RSS swings by the requests in flight, every trim was
    "productive", and the next requests faulted the pages straight back in (medium model at c=32: ~40 minor
    faults per request from the trimmer alone, against ~6 without it). What a burst leaves is given back at
    the first quiet tick.
    """

    growth_bytes: int = 8 << 20
    tick_s: float = 2.0
    eager_tries: int = 8
    accept_after_s: float = 120.0
    busy_cpu_share: float = 0.25
    busy_interval_s: float = 30.0
    floor: int | None = None
    high_since: float | None = None
    tries: int = 0
    next_try_at: float = 0.0
    last_trim_at: float | None = None
    stuck: int | None = None  # the RSS the last unproductive trim left (None: the last trim settled)

    def due(self, rss: int, now: float, cpu_share: float = 0.0) -> bool:
        """Whether to trim now, given this tick's RSS and the share of a core the process used since the
        last tick."""
        if self.floor is None or rss < self.floor:
            self.floor = rss
        if rss <= self.floor + self.growth_bytes:
            self._settle()
            return False
        if self.high_since is None:
            self.high_since, self.tries, self.next_try_at = now, 0, now
        if now - self.high_since >= self.accept_after_s:
            self.floor = rss
            self._settle()
            return False
        if self.stuck is not None and rss > self.stuck + self.growth_bytes:
            self.next_try_at = min(self.next_try_at, now)
        if now < self.next_try_at:
            return False
        busy = cpu_share >= self.busy_cpu_share
        return not (busy and self.last_trim_at is not None and now - self.last_trim_at < self.busy_interval_s)

    def trimmed(self, rss_after: int, now: float) -> None:
        """Record what a trim left: settled when it came back near the floor, else schedule a retry."""
        assert self.floor is not None, "trimmed() before due()"
        self.last_trim_at = now
        if rss_after <= self.floor + self.growth_bytes:
            self.floor = min(self.floor, rss_after)
            self._settle()
            return
        self.tries += 1
        self.stuck = rss_after
        backoff = 0 if self.tries < self.eager_tries else self.tick_s * 2 ** (self.tries - self.eager_tries + 1)
        self.next_try_at = now + backoff

    def _settle(self) -> None:
        self.high_since, self.tries, self.next_try_at, self.stuck = None, 0, 0.0, None


def start_trimmer(interval_s: float = 2.0, growth_bytes: int = 8 << 20) -> bool:
    """A daemon thread that hands freed heap memory back to the OS (glibc ``malloc_trim``) when the
    process's RSS has grown by ``growth_bytes`` (see `TrimPolicy`); False where the C library is not glibc.

    The mmap threshold covers single large blocks; a flood of medium ones (a hostile client's many 100 KiB
    fields, a burst of big batches) still leaves free chunks spread over the heaps that glibc only returns
    on a trim. Trimming on growth rather than on a clock keeps a steady server from paying for it.
    """
    import threading
    import time

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    page = _page_size()

    def rss() -> int:
        try:
            with open("/proc/self/statm", "rb") as statm:  # noqa: PTH123 - a /proc read, not a path API
                return int(statm.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            return 0

    policy = TrimPolicy(growth_bytes=growth_bytes, tick_s=interval_s)

    def run() -> None:
        wall, cpu = time.monotonic(), time.process_time()
        while True:
            time.sleep(interval_s)
            now, used = time.monotonic(), time.process_time()
            share = (used - cpu) / max(now - wall, 1e-3)
            wall, cpu = now, used
            if policy.due(rss(), now, share):
                trim(0)
                policy.trimmed(rss(), time.monotonic())

    threading.Thread(target=run, name="malloc-trim", daemon=True).start()
    return True


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")
