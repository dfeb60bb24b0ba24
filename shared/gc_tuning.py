"""Keep the start-up heap out of Python's cyclic garbage collector (`gc.freeze`), once a service has started.

A started service tracks ~350,000 objects (torch, transformers, the tokenizer, the model's modules) that live as
long as the process. A collection of the oldest generation walks every one of them and finds nothing to free: the
ones each service ran while starting took 150-330 ms (gateway, verifier, proposer; Xeon, 2 cores), and one that
comes while serving stops every stream for as long. They are rare there (a 2-minute gateway benchmark at 1 and 8
clients: 2-11 young collections a service after start-up, no full one), so this is insurance against a pause,
not a speed-up. Frozen, the start-up objects sit in a permanent generation the collector skips (a full collection
of a verifier-sized process: 208 ms, then 0.0 ms); objects made later are collected as before, cycles included.
vLLM freezes the heap of its engine, API server and workers the same way.

Set SPECDEC_GC_FREEZE=0 to leave the collector as Python starts it (e.g. when hunting a leak with gc's tools).
"""

from __future__ import annotations

import gc
import logging
import os

log = logging.getLogger("specdec.gc")


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object tracked now; the number frozen (0 when turned off)."""
    if os.environ.get("SPECDEC_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("event=gc_heap_frozen objects=%d", frozen)
    return frozen
