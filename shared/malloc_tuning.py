"""Keep freed tensor memory in the process instead of handing it back to the kernel (glibc only).

A decoding step allocates and frees the same large CPU tensors every time: logits and probabilities of
[tokens, vocabulary] (49k x 4 bytes per row), gathered K/V, MLP activations. With glibc's defaults a
free of a few MiB goes back to the kernel (an mmap'd chunk, or a trimmed heap top), so the next step's
allocation of the same size page-faults every page in again and the kernel zeroes them. On the
benchmark machine, at batch 8 with the draft model at k = 2, the verification phase took 22 ms with
glibc's defaults and 6 ms with these settings, the whole step 156 ms and 133 ms; a plain decoding step
72 ms and 66 ms. Fixing both thresholds (which also turns off glibc's own adaptive threshold) keeps
such memory in the heap for reuse: the process keeps its peak heap, which for a server that
preallocates its KV cache is what it holds anyway.

One heap, not one per thread: glibc gives threads that allocate at the same time their own arenas, and each
arena keeps its own peak. The services step their engines in thread-pool workers (asyncio.to_thread), so
over hours more workers took turns, each arena grew to a step's size, and resident memory climbed by a step's
worth at a time (the 10-minute soak saw +8% in a verifier and a proposer, docs/RELIABILITY.md). With
M_ARENA_MAX = 1 the process keeps one peak.

Set SPECDEC_MALLOC_TUNING=0 to leave glibc's defaults (e.g. when preloading jemalloc or tcmalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("specdec.malloc")

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's upper limit on 64-bit: chunks up to it come from the heap
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024  # free heap top kept before any is returned to the kernel


def tune_malloc() -> bool:
    """Apply the thresholds once per process; True when they are in effect."""
    if os.environ.get("SPECDEC_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to tune
        return False
    ok = (
        mallopt(M_ARENA_MAX, 1) == 1
        and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if not ok:
        log.warning("mallopt refused the thresholds; glibc's defaults stay in effect")
    return ok
