"""Benchmarks for specdec: the engine against transformers (`python -m specdec_bench.engine_bench`).

OpenMP's default wait policy lets idle torch threads spin; on a small machine shared with other processes
a spinning or descheduled thread stalls every multi-row matmul at the next barrier (measured here: 2-thread
fp32 matmuls of 2-40 rows took 5-20 ms instead of 0.2-1.5 ms while other jobs ran, single-row ones were
unaffected). PASSIVE makes waiting threads sleep instead. It must be set before torch loads libgomp, so it
is set when this package is imported; an explicit OMP_WAIT_POLICY in the environment wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
