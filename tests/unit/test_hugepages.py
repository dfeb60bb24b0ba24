"""shared/hugepages.py: a service's large mappings asked onto huge pages and rebuilt there, contents kept."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

from shared import hugepages

ROOT = Path(__file__).resolve().parents[2]

# In a child process: the advice covers the whole process, and this test process holds every other test's memory.
SCRIPT = """
import json, sys, torch
from shared.hugepages import advise_process_memory
block = torch.arange(32 << 20, dtype=torch.int32)  # 128 MiB, written
expected = int(block.sum(dtype=torch.int64))
start, end = block.data_ptr(), block.data_ptr() + block.numel() * 4
def collapse_alloc_failures():
    for line in open("/proc/vmstat").read().splitlines():
        if line.startswith("thp_collapse_alloc_failed "):
            return int(line.split()[1])
    return 0
failures = collapse_alloc_failures()
first = advise_process_memory("test")
failures = collapse_alloc_failures() - failures
again = advise_process_memory("test")
huge_kb = advised_bytes = 0
for line in open("/proc/self/smaps").read().splitlines():
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo < end and start < hi  # the advice splits the mapping at its first and last huge page
        size = hi - lo
    elif inside and line.startswith("AnonHugePages:"):
        huge_kb += int(line.split()[1])
    elif inside and line.startswith("VmFlags:") and "hg" in line.split()[1:]:  # asked for huge pages
        advised_bytes += size
print(json.dumps({"mode": first.mode, "advised": first.advised_bytes, "rebuilt": first.rebuilt_bytes,
                  "same": again is first, "huge_kb": huge_kb, "tensor_advised": advised_bytes, "failures": failures,
                  "intact": int(block.sum(dtype=torch.int64)) == expected}))
"""


def run_child(env_extra: dict[str, str]) -> dict:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **env_extra}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def collapse_supported() -> bool:  # MADV_COLLAPSE: Linux 6.1
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def test_a_large_written_tensor_is_rebuilt_on_huge_pages_with_its_contents():
    result = run_child({})
    assert result["intact"] and result["same"], result  # contents kept; the second call did nothing again
    mode = hugepages.thp_mode() if sys.platform.startswith("linux") else "unavailable"
    assert result["mode"] == mode, result
    if mode in ("never", "unavailable"):  # nothing to ask for: nothing asked
        assert result["advised"] == result["rebuilt"] == result["tensor_advised"] == 0, result
        return
    # The tensor's own mapping, less its partial huge pages at the ends, is asked for (its VmFlags say so)
    assert result["tensor_advised"] >= 120 << 20 and result["advised"] >= 120 << 20, result
    if collapse_supported() and not result["failures"]:  # and rebuilt on huge pages at once, where the kernel
        # found huge pages to rebuild on (a machine whose memory is too fragmented counts allocation failures)
        assert result["huge_kb"] >= 120 << 10 and result["rebuilt"] >= 120 << 20, result


def test_switched_off_by_the_environment_nothing_is_asked_for():
    result = run_child({"SPECDEC_HUGEPAGES": "0"})
    assert result["mode"] == "unavailable" and result["advised"] == result["rebuilt"] == 0, result
    assert result["tensor_advised"] == 0, result
    if hugepages.thp_mode() == "madvise":  # where the kernel gives huge pages only when asked
        assert result["huge_kb"] == 0, result
    assert result["intact"], result


def test_only_large_private_anonymous_mappings_are_chosen(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "00400000-00600000 r-xp 00000000 08:01 1 /usr/bin/python3\n"  # code
        "01000000-05000000 rw-p 00000000 00:00 0 [heap]\n"  # the heap: 64 MiB
        "7f0000000000-7f0004000000 rw-p 00000000 00:00 0 \n"  # an anonymous mapping: 64 MiB
        "7f1000000000-7f1000100000 rw-p 00000000 00:00 0 \n"  # 1 MiB: too small
        "7f2000000000-7f2004000000 rw-s 00000000 00:05 9 /dev/shm/x\n"  # shared memory
        "7f3000000000-7f3004000000 rw-p 00000000 08:01 2 /data/weights.bin\n"  # a private file mapping
        "7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert hugepages._anonymous_mappings(16 << 20, maps) == [(0x01000000, 0x05000000), (0x7F0000000000, 0x7F0004000000)]


def test_a_failure_to_ask_is_logged_and_the_service_starts_without(monkeypatch, caplog):
    def broken(service: str) -> hugepages.Advised:
        raise FileNotFoundError("/proc/self/maps")

    monkeypatch.setattr(hugepages, "_advised", None)
    monkeypatch.setattr(hugepages, "_advise", broken)
    with caplog.at_level("WARNING", logger="specdec.hugepages"):
        assert hugepages.advise_process_memory("verifier") == hugepages.Advised("unavailable")
    assert "verifier: huge pages not asked for: FileNotFoundError" in caplog.text
