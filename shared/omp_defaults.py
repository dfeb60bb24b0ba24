"""OpenMP for the services: the spin time, set before torch (and with it libgomp) loads, and the one thread a
service's model runs on.

After a parallel region libgomp's workers spin, by default about 300,000 turns (several milliseconds here), before
they sleep. Inside a forward that spin covers the gaps between a step's ~120 products; after the step it keeps a
core busy for nothing, and where the verifier and the proposer share the cores (co-located, `make run`) each
process's spinning workers took a core from the other's turn. 30,000 turns still cover the gaps (the target-only
stack through the gateway 20.7 tok/s against 20.9 at the default; 3,000 did not: 16.8) and release the cores
soon after a step: `make run`'s speculating stack 1.47x -> 1.56x target-only at 1 client greedy, 1.13x -> 1.27x
at T = 0.8, 1.01x -> 1.05x at 8 clients (2 cores, AMX host, 2026-12-02, docs/BENCHMARKS.md).

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept (the test suite, and the process stacks of
specdec_local.processes that the soak and edge probes start, set PASSIVE for their many processes)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

SPIN_COUNT = 30_000


def apply() -> None:
    """Before torch is imported (the service packages' __init__): the services' default spin count."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


def model_thread(name: str) -> ThreadPoolExecutor:
    """The one-worker executor a service loads, warms up and runs its model on, all of it. libgomp keeps a team of
    OpenMP workers for each thread that runs parallel torch work, and once a process holds more such threads than
    CPUs it stops letting them spin between parallel regions: each of a step's ~120 products then wakes a sleeping
    worker (in a VM an interrupt through the hypervisor). With the verifier's warm-up on one asyncio.to_thread
    worker and its steps on others, target-only steps took 62 ms where the same engine in one thread took ~43
    (2 cores, AMX host, 2026-12-02; docs/services.md)."""
    return ThreadPoolExecutor(1, thread_name_prefix=name)
