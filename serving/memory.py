"""How the server process uses the C library's allocator: set once, at process start, before any thread."""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameters


def bound_heap_retention(threshold: int = 128 << 10, arenas: int = 2) -> bool:
    """Make glibc give freed large blocks back: every allocation from ``threshold`` up mapped on its own and
    unmapped when freed, and at most ``arenas`` heaps; returns whether both were set (False where the C
    library is not glibc).

    By default glibc raises the threshold to the size of each large block freed (up to 32 MiB), so after
    one 4 MiB request later ones come from the heaps, and it keeps up to 8 heaps per core, one per thread
    that allocates, each holding what its thread freed: with 64 gRPC threads, five requests with 4 MiB
    model names left the server 30-50 % above its start-up RSS for good (two heaps: 10 %). Process-wide,
    and a heap limit only binds threads started after it: ``python -m serving`` calls it first thing.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_ARENA_MAX, arenas))


def start_trimmer(interval_s: float = 2.0, growth_bytes: int = 8 << 20) -> bool:
    """A daemon thread that hands freed heap memory back to the OS (glibc ``malloc_trim``) whenever the
    process's RSS has grown by ``growth_bytes`` since the last trim; False where the C library is not glibc.

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

    def run() -> None:
        floor = rss()
        while True:
            time.sleep(interval_s)
            now = rss()
            if now > floor + growth_bytes:
                trim(0)
                floor = rss()
            elif now < floor:
                floor = now

    threading.Thread(target=run, name="malloc-trim", daemon=True).start()
    return True


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")
