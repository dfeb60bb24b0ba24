"""Benchmarks for specdec: the engine against transformers (`python -m specdec_bench.engine_bench`)."""
