"""Where a process runs: its machine and the CPU cores it may use, so that a verifier can tell whether its
proposer competes with it for the same cores (both services on one CPU host, without pinning).

Co-located on two CPU cores, everything the proposer computes beside a verifier's forward is taken from that
forward: following the sequences that decode plainly (their features ingested every k tokens) cost a speculative
stack at 8 clients about 7% of its throughput (0.88x target-only with it, 0.945x without; docs/BENCHMARKS.md).
On its own device the same work is free, and it keeps a later probe's catch-up short."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from functools import cache
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@cache
def host_id() -> str:
    """The running kernel's boot id, which every container on one machine shares (pods on one Kubernetes node
    compete for its cores), else the host name."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def cpu_set() -> frozenset[int]:
    """The cores this process may run on (its affinity: taskset, a cpuset); empty where the OS does not say."""
    affinity = getattr(os, "sched_getaffinity", None)
    return frozenset(affinity(0)) if affinity is not None else frozenset()


def shares_cores(other_host: str, other_cpus: Iterable[int]) -> bool:
    """Whether a process on `other_host`, allowed `other_cpus`, may run on this process's cores. A peer that
    does not say where it runs (an older one: empty host) is taken to run elsewhere, as before this check;
    on this host, cores not stated on either side count as shared."""
    if not other_host or other_host != host_id():
        return False
    mine, theirs = cpu_set(), frozenset(other_cpus)
    return not mine or not theirs or bool(mine & theirs)
