"""Benchmarks for specdec: the engine against transformers (`python -m specdec_bench.engine_bench`), the same
workloads through the services, and the rest of `make bench`.

They measure what users run: the services' and the engine's own settings, nothing set here. OpenMP's wait
policy in particular is left as the environment has it (the services' default, docs/engine.md); each report
records it, and `OMP_WAIT_POLICY=PASSIVE make bench` (or any value) measures another choice.
"""
