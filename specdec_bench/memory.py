"""Process memory as the operating system sees it (resident set size), for the benchmark's memory columns.

tracemalloc does not see torch's allocations, so we read RSS: `PeakRSS` samples /proc/self/statm from a
background thread (every `interval_s`) and reports the highest value seen above the RSS at entry; a spike
shorter than the interval can be missed. `trim_heap` returns freed heap pages to the OS first (glibc's
malloc_trim), so memory a previous configuration freed is not silently reused and hidden from the next.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import resource
import sys
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def max_rss() -> int:
    """High-water RSS of this process since it started (getrusage ru_maxrss), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def trim_heap() -> None:
    gc.collect()
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


class PeakRSS:
    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def delta(self) -> int:
        """Peak RSS inside the block minus RSS at entry, in bytes."""
        return max(0, self.peak - self.baseline)

    def __enter__(self) -> PeakRSS:
        trim_heap()
        self.baseline = self.peak = current_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, current_rss())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, current_rss())
