"""shared/malloc_tuning.py: glibc's thresholds are set, or left alone when switched off."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shared.malloc_tuning import tune_malloc

ROOT = Path(__file__).resolve().parents[2]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_MALLOC_TUNING", "0")
    assert tune_malloc() is False


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_large_blocks_come_from_the_heap_and_stay_after_free():
    # In a child process, so this test process keeps glibc's defaults. glibc's counters (mallinfo2):
    # hblkhd = bytes in mmap'd blocks (returned to the kernel on free), arena = bytes of heap it holds.
    script = """
import ctypes, sys, torch
from shared.malloc_tuning import tune_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "on":
    assert tune_malloc()
before = libc.mallinfo2()
block = torch.empty(16 << 20, dtype=torch.uint8)
held = libc.mallinfo2()
del block
freed = libc.mallinfo2()
print(held.hblkhd - before.hblkhd, held.arena - before.arena, held.arena - freed.arena)
"""
    result = {}
    for mode in ("on", "off"):
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, env=env, check=True, cwd=ROOT
        )
        result[mode] = tuple(int(x) for x in out.stdout.split())  # mmap'd, heap grown, heap trimmed on free
    mmapped, grown, trimmed = result["on"]
    assert mmapped == 0 and grown >= 15 << 20 and trimmed == 0, result  # from the heap, and kept after free
    mmapped, grown, trimmed = result["off"]
    assert mmapped >= 16 << 20 and grown < 1 << 20, result  # glibc's default: mmap'd, unmapped on free


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_threads_that_allocate_at_once_share_one_heap():
    # Four threads allocate at the same moment; glibc's malloc_stats() lists one "Arena N:" per arena.
    script = """
import ctypes, sys, threading
from shared.malloc_tuning import tune_malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "on":
    assert tune_malloc()
barrier = threading.Barrier(4)
def work():
    barrier.wait()
    blocks = [libc.malloc(1 << 16) for _ in range(64)]
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
"""
    arenas = {}
    for mode in ("on", "off"):
        env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, env=env, check=True, cwd=ROOT
        )
        arenas[mode] = out.stderr.count("Arena ")
    assert arenas["on"] == 1 and arenas["off"] > 1, arenas
