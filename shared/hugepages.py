"""Transparent huge pages for what a service keeps for its whole life: the weights and the KV cache.

A decoding step at batch 1 to 8 reads every weight from memory once. On 4 KiB pages that is a TLB miss every
4 KiB, and the CPU's prefetchers stop at every page boundary; on 2 MiB pages neither happens. Linux backs
anonymous memory with huge pages on its own only where THP is `always`; most distributions ship `madvise`, where a
process has to ask (madvise MADV_HUGEPAGE). Memory already written (the loaded weights, the zeroed cache) is
rebuilt on huge pages at once with MADV_COLLAPSE (Linux 6.1 and later); on older kernels MADV_HUGEPAGE alone lets
khugepaged do it in the background, a few MiB every ten seconds.

Each service calls `advise_process_memory` once its model is loaded and warmed up: every large anonymous
mapping (the heap, where glibc puts tensors below its mmap threshold, and the mmap'd larger ones), not the
tensors one by one, so that whatever a drafter or the target holds is covered. Advising the heap before loading
does not carry over: the heap grows by new mappings without the advice.

Against the same services on 4 KiB pages in one run (2 cores, Zen 4 host, THP `madvise`; docs/BENCHMARKS.md),
decoding through the gateway ran 4-6% faster where a step is memory-bound (fp32 at one client, bf16 at eight)
and within 3% elsewhere; the verifier's start took 0.9-2.9 s longer (0.8-1.4 GiB rebuilt).

`SPECDEC_HUGEPAGES=0` leaves the pages as they are (an A/B: `step_phases --stacks target,target-4k`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("specdec.hugepages")

HUGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MIN_MAPPING = 8 * HUGE  # smaller anonymous mappings (Python objects, thread stacks) are left alone
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class Advised:
    mode: str  # the system's THP setting: always, madvise, never, or unavailable (not Linux, switched off)
    advised_bytes: int = 0  # asked to be on huge pages
    collapsed_bytes: int = 0  # rebuilt on huge pages now (MADV_COLLAPSE)


_advised: Advised | None = None


def thp_mode() -> str:
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "unavailable"


def _anonymous_mappings(min_bytes: int, maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
    """(start, end) of this process's private, writable, anonymous mappings (the heap included) of at least
    `min_bytes`: where glibc puts large tensors."""
    out = []
    for line in maps.read_text().splitlines():
        fields = line.split()
        perms, path = fields[1], fields[5] if len(fields) > 5 else ""
        if perms != "rw-p" or (path and path != "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if end - start >= min_bytes:
            out.append((start, end))
    return out


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def advise_process_memory(service: str, min_bytes: int = MIN_MAPPING) -> Advised:
    """Ask for huge pages under every large anonymous mapping, and rebuild what is already there on them (logged
    for `service`). Call it once the weights and the cache are in memory."""
    global _advised
    if _advised is not None:  # once a process: a test process starts many services in it
        return _advised
    _advised = _advise(service, min_bytes)
    return _advised


def _advise(service: str, min_bytes: int) -> Advised:
    off = os.environ.get("SPECDEC_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux")
    mode = "unavailable" if off else thp_mode()
    if mode in ("never", "unavailable"):
        log.info("%s: huge pages not asked for (transparent huge pages: %s)", service, mode)
        return Advised(mode)
    libc, started = _libc(), time.monotonic()
    advised = collapsed = 0
    for start, end in _anonymous_mappings(min_bytes):
        first, last = -(-start // HUGE) * HUGE, end // HUGE * HUGE  # whole huge pages inside the mapping
        if last <= first:
            continue
        if libc.madvise(first, last - first, MADV_HUGEPAGE) == 0:
            advised += last - first
        if libc.madvise(first, last - first, MADV_COLLAPSE) == 0:
            collapsed += last - first
    log.info(
        "%s: huge pages asked for mib=%d rebuilt_now_mib=%d seconds=%.1f (transparent huge pages: %s)",
        service, advised >> 20, collapsed >> 20, time.monotonic() - started, mode,
    )  # fmt: skip
    return Advised(mode, advised, collapsed)
