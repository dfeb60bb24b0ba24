"""Transparent huge pages for what a service keeps for its whole life: the weights and the KV cache.

A decoding step at batch 1 to 8 reads every weight from memory once. On 4 KiB pages that is a TLB miss every
4 KiB, and the CPU's prefetchers stop at every page boundary; on 2 MiB pages neither happens. Linux backs
anonymous memory with huge pages on its own only where THP is `always`; most distributions ship `madvise`, where a
process has to ask (madvise MADV_HUGEPAGE). Memory already written (the loaded weights, the zeroed cache) is
rebuilt on huge pages at once with MADV_COLLAPSE (Linux 6.1 and later); on older kernels MADV_HUGEPAGE alone lets
khugepaged do it in the background, a few MiB every ten seconds.

Each service calls `advise_process_memory` once its model and cache are in memory (the verifier before its
warm-up, whose timings the speculation policy starts from; the proposer once its drafter is built; each
tensor-parallel rank once its shard is): every large anonymous mapping (the heap, where glibc puts tensors below
its mmap threshold, and the mmap'd larger ones), not the tensors one by one, so that whatever a drafter or the
target holds is covered. Advising the heap before loading does not carry over: the heap grows by new mappings
without the advice. MADV_COLLAPSE fills in the untouched small pages of a huge page it rebuilds (at most 2 MiB a
hole), and the advice overrides a library's MADV_NOHUGEPAGE on those mappings.

Against the same services on 4 KiB pages in one run (2 cores, Zen 4 host, THP `madvise`; docs/BENCHMARKS.md),
decoding through the gateway ran 4-6% faster where a step is memory-bound (fp32 at one client, bf16 at eight)
and within 3% elsewhere; the verifier's start took 0.9-3.1 s longer (0.7-1.4 GiB rebuilt).

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

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP = Path("/sys/kernel/mm/transparent_hugepage")


@dataclass(frozen=True)
class Advised:
    mode: str  # the system's THP setting: always, madvise, never, or unavailable (not Linux, switched off, failed)
    advised_bytes: int = 0  # asked to be on huge pages
    rebuilt_bytes: int = 0  # more anonymous memory on huge pages afterwards than before (AnonHugePages)


_advised: Advised | None = None


def thp_mode() -> str:
    try:
        text = (THP / "enabled").read_text()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "unavailable"


def huge_page_bytes() -> int:
    """2 MiB on x86-64; 32 or 512 MiB on arm64 kernels with 16 or 64 KiB pages."""
    try:
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 * 1024 * 1024


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


def _huge_resident() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def advise_process_memory(service: str) -> Advised:
    """Ask for huge pages under every large anonymous mapping (8 huge pages or more), and rebuild what is already
    there on them (logged for `service`). Call it once the weights and the cache are in memory. Never fatal: it
    is a speed-up, and a service starts without it."""
    global _advised
    if _advised is not None:  # once a process: a test process starts many services in it
        return _advised
    try:
        _advised = _advise(service)
    except (OSError, AttributeError, TypeError, ValueError) as err:
        log.warning("%s: huge pages not asked for: %s: %s", service, type(err).__name__, err)
        _advised = Advised("unavailable")
    return _advised


def _advise(service: str) -> Advised:
    off = os.environ.get("SPECDEC_HUGEPAGES", "1") == "0" or not sys.platform.startswith("linux")
    mode = "unavailable" if off else thp_mode()
    if mode in ("never", "unavailable"):
        why = "SPECDEC_HUGEPAGES=0" if os.environ.get("SPECDEC_HUGEPAGES") == "0" else f"transparent huge pages: {mode}"
        log.info("%s: huge pages not asked for (%s)", service, why)
        return Advised(mode)
    libc, huge, started, before = _libc(), huge_page_bytes(), time.monotonic(), _huge_resident()
    advised = 0
    for start, end in _anonymous_mappings(8 * huge):
        first, last = -(-start // huge) * huge, end // huge * huge  # whole huge pages inside the mapping
        if libc.madvise(first, last - first, MADV_HUGEPAGE) == 0:
            advised += last - first
        # Not checked: it fails for the whole range if one huge page could not be rebuilt; the others still are.
        libc.madvise(first, last - first, MADV_COLLAPSE)
    rebuilt = max(0, _huge_resident() - before)
    log.info(
        "%s: huge pages asked for mib=%d rebuilt_now_mib=%d seconds=%.1f (transparent huge pages: %s)",
        service, advised >> 20, rebuilt >> 20, time.monotonic() - started, mode,
    )  # fmt: skip
    return Advised(mode, advised, rebuilt)
