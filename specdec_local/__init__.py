"""In-process composition: the verifier's engine with a drafter running in the same process.

Tests, benchmarks and the README example use it. It is the one place that imports both services; the
services themselves meet only over gRPC.
"""
